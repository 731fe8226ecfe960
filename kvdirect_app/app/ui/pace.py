"""How often the page redraws while something streams (a turn, a replay): the rates every handler shares."""

# At most this often a streamed update (the first token of a turn always goes out).  An update re-sends every
# pane's chat, the scoreboard and the status, and Gradio's serialising and the browser's drawing share the cores
# with the engine: a 64-token turn of the seven default panes took 21-22 s from Send to Done at 0.12 s here
# (2-core CPU, Chromium on the same cores), 19.7-20.3 s at 0.5 s, 18.4 s at 1 s.
UI_EVERY_S = 0.5
HEARTBEAT_S = 5.0  # with no event for this long (a long message is read in pieces of minutes), the time is redrawn
PLOTS_EVERY_S = 2.0  # live plots at most this often during a turn ...
PLOTS_SHARE = 0.05  # ... and, when building them takes longer, never more than this share of the turn's time
