"""The web app: the torch-free facade the UI reaches the engine through (`service`), its torch side (`engine_side`,
which `service` imports on first use), the entry point (`studio`) and the Gradio page (`ui/`).  Nothing here but
`engine_side` imports torch at module level."""
