"""The examples' own rules, without a model: tic-tac-toe against a scripted player, the email
inbox and its tools (the examples' training runs on the real model are in the integration tier)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import journeyman as jm
from tests.example_scripts import load


class ScriptedClient:
    """An OpenAI-shaped client that answers with the given replies in order, and keeps the requests.
    A reply of None names the first empty cell of the board in the last user message."""

    def __init__(self, replies: list[str | None]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=self)

    async def create(self, **request: Any) -> Any:
        self.requests.append(json.loads(json.dumps(request)))
        reply = self.replies.pop(0) if self.replies else None
        if reply is None:
            board = request["messages"][-1]["content"].split("\n\n")[-2]
            reply = next(c for c in board if c.isdigit())
        message = SimpleNamespace(content=reply, tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


async def test_tic_tac_toe_rules_illegal_moves_and_forfeit() -> None:
    game = load("tic_tac_toe")
    args = game.parse_args(["--max-illegal", "1", "--skill", "1.0"])
    play = game.make_agent(
        jm.Model(name="scripted", project="t", inference_base_url="http://unused/v1"), args
    )
    # X takes 1, 2 and 3 in a row unless O blocks; with skill 1 O blocks, so X must adapt.
    assert game.winner(list("XXX      ")) == "X" and game.winner(list("XOX      ")) is None
    assert game.parse_move("I pick 5.") == 4 and game.parse_move("middle") is None
    assert game.opponent_move(list("XX  O    "), __import__("random").Random(0), 1.0) == 2  # blocks

    # An occupied cell, then no number at all: two illegal moves with --max-illegal 1 forfeit.
    scenario = {"id": "g", "seed": 0, "x_first": True}
    client = ScriptedClient(["5", "5", "the centre"])
    assert await play.function(scenario, client=client) == game.REWARDS["forfeit"]
    last = client.requests[-1]["messages"]
    assert last[-1]["content"].startswith(f"{game.ILLEGAL}: cell 5 is taken")
    assert sum(m["role"] == "user" and m["content"].startswith(game.ILLEGAL) for m in last) == 1

    # One illegal move is forgiven: the model is told why and asked again; the game goes on to an end.
    client = ScriptedClient(["5", "5"])
    reward = await play.function(scenario, client=client)
    assert reward in game.REWARDS.values() and reward != game.REWARDS["forfeit"]
    last = client.requests[-1]["messages"]
    assert sum(m["role"] == "user" and m["content"].startswith(game.ILLEGAL) for m in last) == 1
    assert 4 <= len(client.requests) <= 6  # X's moves: 3 to 5 legal ones, and the illegal one


def test_email_inbox_and_tools(tmp_path: Path) -> None:
    email = load("email_search")
    emails, questions = email.make_inbox(seed=0, size=60)
    assert (emails, questions) == email.make_inbox(seed=0, size=60)  # seeded
    assert len(questions) == 51 and len({q["question"] for q in questions}) == 51
    subjects = [e.subject for e in emails]
    assert all(subjects.count(emails[q["email_id"] - 1].subject) == 1 for q in questions)  # one email each
    assert len(questions) >= 4
    email.write_inbox(emails, tmp_path / "inbox.sqlite")
    inbox = email.Inbox(tmp_path / "inbox.sqlite")
    for question in questions:
        target = emails[question["email_id"] - 1]
        assert question["answer"] in target.body
        # The question's own words find its email, and reading it shows the answer.
        assert f"id {target.id} |" in inbox.search_emails(question["question"])
        assert question["answer"] in inbox.read_email(target.id)
        right = {str(target.id)}
        assert email.grade(question, f"It is {question['answer']}.", set(), set()) == 1.0
        assert email.grade(question, "no idea", right, right) == 0.2
        assert email.grade(question, "no idea", right, set()) == 0.1
        assert email.grade(question, None, {"0"}, {"0"}) == 0.0
    with pytest.raises(email.ToolError, match="no email with id 9999"):
        inbox.read_email(9999)
    with pytest.raises(ValueError):
        inbox.read_email("the first one")
    with pytest.raises(email.ToolError, match="keywords"):
        inbox.search_emails("?!")
    assert inbox.search_emails('AND OR "NEAR(') != ""  # FTS5 syntax in a query is only words to us
    inbox.close()
