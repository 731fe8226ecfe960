"""The web app: the torch-free facade the UI reaches the engine through (`service`), the entry point
(`studio`) and the Gradio page (`ui/`).  Nothing here imports torch at module level."""
