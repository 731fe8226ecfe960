"""Retrieval tasks after RULER (generate.py), a QA set for the long document (qa.py), and the tokenizer of a preset
without its model (tokenizer.py)."""
