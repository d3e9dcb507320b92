"""Fork with edits in a real browser (issue 34 item 1): the form shows the input and each
copied step's output (a model call's as its text), the fork goes on from the edited answer, and
both pages pass axe in both themes and at 390 px."""

import re

import pytest

from runs.sdk import start_run
from tests.test_browser import AXE, _form_with, login, shoot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def axe_problems(page) -> list[str]:
    page.add_script_tag(path=AXE)
    return page.evaluate(
        "async () => (await axe.run(document, {runOnly: ['wcag2a', 'wcag2aa', 'wcag21a',"
        " 'wcag21aa']})).violations.filter(v => ['serious', 'critical'].includes(v.impact))"
        ".map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', '))"
    )


@pytest.mark.parametrize("scheme", ["light", "dark", "narrow"])
def test_an_operator_edits_what_the_model_said_and_forks_from_the_next_step(
    server,
    browser,
    cast,
    drive,
    demo_model,
    scheme,
):
    from playwright.sync_api import expect

    from runs.models import Run, Step

    origin = start_run("llm-async", {})
    assert drive() == ["completed"]
    narrow = {"viewport": {"width": 390, "height": 844}} if scheme == "narrow" else {}
    context = browser.new_context(bypass_csp=True, **narrow)  # axe goes in inline
    page = context.new_page()
    page.set_default_timeout(10_000)
    page.emulate_media(color_scheme="dark" if scheme == "dark" else "light")
    login(page, server, "otto", f"/runs/{origin.pk}")

    page.get_by_text("Fork from a step").click()
    page.get_by_role("radio", name=re.compile(r"^from after \(")).check()
    preview = page.locator("#fork-preview")
    expect(preview).to_contain_text(re.compile(r"reuses 2 recorded steps\b"))
    preview.get_by_text("Edit what the fork starts from").click()
    answer = preview.get_by_label(re.compile(r"^What the model said in ask"))
    expect(answer).to_have_value(re.compile(r"^\[demo model\]"))
    expect(preview.get_by_label(re.compile(r"^Output of fetch"))).to_have_value("42")
    answer.fill("A kinder answer.")
    form = _form_with(page, "Fork")
    form.get_by_label("Reason").fill("try a kinder answer")
    problems = {"form": axe_problems(page)}
    shoot(page.locator("#fork"), f"{scheme}-fork-with-edits")
    form.get_by_role("button", name="Fork", exact=True).click()

    page.wait_for_url(re.compile(r"/runs/(?!" + str(origin.pk) + ")"))
    fork = Run.objects.get(forked_from=origin)
    expect(page.locator("#run-forked-from")).to_contain_text(
        f"forked from {str(origin.pk)[:8]} at step after (#2), with the output of step ask edited"
    )
    assert drive() == ["completed"]
    expect(page.locator("#run-status")).to_have_text("completed")
    assert Run.objects.get(pk=fork.pk).output == [42, "A kinder answer."]
    assert Step.objects.get(run=fork, key="ask").output["choices"][0]["message"]["content"] == (
        "A kinder answer."
    )
    page.reload()  # the finished fork as an operator opening it reads it
    expect(page.locator("#run-forked-from")).to_contain_text("with the output of step ask edited")
    problems["fork"] = axe_problems(page)
    shoot(page, f"{scheme}-run-edited-fork", full_page=True)
    page.goto(f"{server}/runs/{origin.pk}")
    expect(page.locator("#run-forks").get_by_role("link", name=str(fork.pk)[:8])).to_be_visible()
    context.close()
    assert not any(problems.values()), problems
