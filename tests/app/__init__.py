"""Tests of `kvdirect_app.app`: the web page (in-process over gradio_client, and in a headless browser), its
views, uploads, serving rules and install."""
