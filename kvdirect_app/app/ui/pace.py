"""How often the page redraws while something streams (a turn, a replay): the rates every handler shares.

Every update shares the cores with the engine: Gradio's serialising, the handler's drawing, the browser's layout.
These rates were chosen by timing a live turn in Chromium on a 2-core CPU (`scripts/app_timing.py`): fewer updates
and fewer live plots shortened Send to Done; the turn with the rates below is in docs/perf.md (issue 57).
"""

# At most this often a streamed update (the first token of a turn, a turn's start and end always go out).
UI_EVERY_S = 1.0
HEARTBEAT_S = 5.0  # with no event for this long (a long message is read in pieces of minutes), the time is redrawn
PLOTS_EVERY_S = 5.0  # live plots at most this often during a turn (always at its end) ...
PLOTS_SHARE = 0.05  # ... and, when building them takes longer, never more than this share of the turn's time
