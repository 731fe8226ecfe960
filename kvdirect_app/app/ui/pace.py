"""How often the page redraws while something streams (a turn, a replay): the rates every handler shares.

Every update shares the cores with the engine: Gradio's serialising, the handler's drawing, the browser's layout.
A 64-token turn of the seven default panes, Send to Done in Chromium on a 2-core CPU (`scripts/app_timing.py`, the
fixed-order kernels' own team, an update carrying only what changed): 13.6-14.3 s with an update every 0.5 s and
the plots every 2 s, 13.1 s with the plots at the turn's end only, 10.7-11.0 s with that and an update a second
(`bench run`'s engine time for the same turn: 7.3-8.1 s).
"""

# At most this often a streamed update (the first token of a turn, a turn's start and end always go out).
UI_EVERY_S = 1.0
HEARTBEAT_S = 5.0  # with no event for this long (a long message is read in pieces of minutes), the time is redrawn
PLOTS_EVERY_S = 5.0  # live plots at most this often during a turn (always at its end) ...
PLOTS_SHARE = 0.05  # ... and, when building them takes longer, never more than this share of the turn's time
