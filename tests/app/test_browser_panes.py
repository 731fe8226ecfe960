"""Adding and removing a pane in a real Chromium on SmolLM2 (`test_browser`'s page and fixtures): before Send the
page says beside the message box what the next Send replays; on Send only the new pane replays the earlier turns,
and every pane ends with every turn's reply.

STUDIO_JOIN_SHOT=docs/pane-join.png keeps a screenshot of the notice (the README's).
"""

import os

from .test_browser import browser, replies, send, server_log, set_new_tokens, settings, status, url, visitor  # noqa: F401  (the page's fixtures)

NOTICE = "document.querySelector('#kvd-next').innerText"


def done(page, turns: int, timeout_s: int = 600) -> str:
    """The status once it says the run of `turns` turns ended (or failed): the last run's "Done" may still show."""
    page.wait_for_function(
        f"(s => s.includes('Done: {turns} turn(s)') || /Stopped|failed|error|Cannot|refused/i.test(s))"
        "(document.querySelector('#kvd-status').innerText)",
        timeout=timeout_s * 1000,
    )
    return status(page)


def tick(page, name: str):
    settings(page)
    page.get_by_label(name).click()
    settings(page, False)


def test_a_pane_added_after_two_turns_is_announced_and_replays_them_alone(visitor):  # noqa: F811
    """The same mutation as `test_panes_join`'s (every change of panes rebuilds) would fail it: the status would
    say "Settings changed: rebuilding" and never "Adding pane(s)"."""
    page = visitor
    set_new_tokens(page, 8)
    tick(page, "SnapKV (snapkv)")  # six of the seven default panes; SnapKV comes later
    for n, text in enumerate(("Name a colour.", "Name another one."), 1):
        send(page, text)
        assert f"Done: {n} turn(s)" in done(page, n), status(page)
    panes = page.locator(".kvd-pane:visible").count()
    assert panes == 6
    assert page.evaluate(NOTICE).strip() == ""
    tick(page, "SnapKV (snapkv)")
    page.wait_for_function(f"{NOTICE}.includes('Next Send adds snapkv')", timeout=30_000)
    said = page.evaluate(NOTICE)
    assert "replaying the 2 earlier turns for it" in said and "not recomputed" in said, said
    box, notice = page.locator("#kvd-prompt").bounding_box(), page.locator("#kvd-next").bounding_box()
    assert 0 <= notice["y"] - (box["y"] + box["height"]) < 40, (box, notice)  # right under the box, on screen
    assert notice["y"] + notice["height"] <= 720
    if os.environ.get("STUDIO_JOIN_SHOT"):
        page.screenshot(path=os.environ["STUDIO_JOIN_SHOT"])
    send(page, "And a third?")
    page.wait_for_function(
        "document.querySelector('#kvd-status').innerText.includes('Adding pane(s): replaying earlier turn')",
        timeout=120_000,
    )
    assert "Done: 3 turn(s); turn 3:" in done(page, 3), status(page)
    page.wait_for_function(f"{NOTICE}.trim() == ''", timeout=30_000)  # said again after the run: nothing to replay
    assert page.locator(".kvd-pane:visible").count() == panes + 1
    assert len([r for r in replies(page) if r.strip()]) == 3 * (panes + 1)
    # A pane taken away: said before Send, nothing replayed.
    tick(page, "SnapKV (snapkv)")
    page.wait_for_function(f"{NOTICE}.includes('Next Send removes snapkv')", timeout=30_000)
    send(page, "And a fourth?")
    final = done(page, 4)
    assert "Done: 4 turn(s); turn 4:" in final, final
    assert page.locator(".kvd-pane:visible").count() == panes


def test_a_cut_name_in_a_dropdown_reads_whole_on_hover(url, browser):  # noqa: F811
    """The Token map's strategy pickers are narrower than a spec such as `anchorkv:spacing=30:budget=64:rebuild=turn`:
    the value, and each option of the open list, reads whole on hover (its title).  Mutation that fails it: the
    page's start script without its hover handler."""
    from .test_browser import open_page

    page = open_page(browser, 1280, 720)
    page.goto(url)
    page.wait_for_selector("#kvd-send", timeout=60_000)
    page.get_by_role("tab", name="Token map", exact=True).click()
    picker = page.locator("#kvd-map-label input").first
    picker.hover()
    page.wait_for_timeout(200)
    value = picker.input_value()
    assert value and picker.get_attribute("title") == value, (value, picker.get_attribute("title"))
    picker.click()
    options = page.locator("li[role=option]")
    assert options.count() >= 2
    longest = max(range(options.count()), key=lambda i: len(options.nth(i).get_attribute("aria-label") or ""))
    option = options.nth(longest)
    option.hover()
    page.wait_for_timeout(200)
    name = option.get_attribute("aria-label")
    assert ":" in name and option.get_attribute("title") == name, (name, option.get_attribute("title"))
    assert not page.console_errors, page.console_errors
    page.context.close()
