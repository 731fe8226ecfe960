"""The one base of every error a user's input can cause (a setting, a model, a prompt, a memory refusal).

Whatever catches it (the CLI, the `compare` endpoint, the UI handlers) shows
its message as one line and stays up; anything else is a bug, logged with
its traceback on the server and reported to the user without it.
"""


class UserError(ValueError):
    """Bad input or a refused run; the message names the setting and its allowed values."""


class OutOfMemory(RuntimeError):
    """A run that ran out of memory although the guard let it start; the session is freed, the process stays up."""
