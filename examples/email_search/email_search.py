"""An ART·E-style email agent: search a synthetic inbox, read, answer; trained with @jm.trainable.

The example writes a small inbox (seeded, so the same every run) into SQLite FTS5, with questions
whose answers sit in one email each. The agent has three tools: ``search_emails``, ``read_email``
and ``answer``. The reward comes from the known answer (1 when right, a little for finding and
reading the right email); ``--judge ruler`` mixes in a RULER score (``--judge-weight 1
--reward-weight 0``: the judge's alone). The inbox's last ``--val-questions`` are held out and
evaluated before and after training.

    python examples/email_search/email_search.py                    # 10 steps, groups of 8
    python examples/email_search/email_search.py --steps 1 --group-size 2 --questions 2 --max-tokens 48
    python examples/email_search/email_search.py --steps 100 --max-train-minutes 30 \\
        --judge ruler --judge-model qwen2.5-coder-1.5b --judge-method verdict --judge-weight 1 --reward-weight 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman.backend import LocalBackend

# The inbox ------------------------------------------------------------------------------------

CITIES = ["Lisbon", "Oslo", "Denver", "Nairobi", "Osaka", "Lima", "Prague", "Dublin", "Hanoi", "Quito",
          "Tunis", "Perth", "Bergen", "Cusco", "Seville", "Tallinn", "Hobart", "Accra", "Porto", "Kyoto"]  # fmt: skip
ITEMS = ["desk lamp", "rain jacket", "coffee grinder", "bike helmet", "yoga mat", "backpack", "kettle",
         "standing fan", "tea set", "wall clock", "toaster", "sleeping bag", "blender", "water bottle",
         "umbrella", "office chair"]  # fmt: skip
VENDORS = ["Brightwater Plumbing", "Northwind Energy", "Acme Insurance", "Greenleaf Gardens", "City Dental",
           "Bluepeak Mobile", "Harbor Storage", "Maple Vet Clinic", "Summit Gym", "Riverside Water",
           "Copperline Internet", "Oakridge Legal"]  # fmt: skip
TOPICS = ["budget review", "design sync", "hiring plan", "quarterly planning", "launch retro",
          "security audit", "offsite agenda", "pricing update", "vendor review", "onboarding plan",
          "roadmap check-in", "board prep"]  # fmt: skip
PEOPLE = ["maria@work.example", "tom@work.example", "li@work.example", "sara@work.example"]
NOISE = [
    ("Weekly newsletter", "Ten tips for a tidy desk and a calmer week. Unsubscribe any time."),
    ("Your password was changed", "If this was not you, contact support right away."),
    ("Lunch on Friday?", "Shall we try the new noodle place near the office?"),
    ("Photos from the weekend", "Here are the pictures from the hike. The view was great."),
]


@dataclass(frozen=True)
class Email:
    id: int
    sender: str
    date: str
    subject: str
    body: str


def _code(rng: random.Random, length: int = 6) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(length))


def make_inbox(seed: int, size: int) -> tuple[list[Email], list[dict[str, Any]]]:
    """``size`` emails and one question per email that holds an answer (about 3 in 4 do, while the
    cities, items, vendors and topics last: each is used once, so every question picks out one email)."""
    rng = random.Random(seed)
    pools = {name: rng.sample(values, len(values)) for name, values in
             (("flight", CITIES), ("parcel", ITEMS), ("meeting", TOPICS), ("invoice", VENDORS))}  # fmt: skip
    emails: list[Email] = []
    questions: list[dict[str, Any]] = []
    for number in range(1, size + 1):
        date = f"2026-{rng.randint(1, 11):02d}-{rng.randint(1, 28):02d}"
        kind = rng.choice(["flight", "parcel", "meeting", "invoice", "noise"])
        if kind != "noise" and not pools[kind]:
            kind = "noise"
        if kind == "flight":
            city, code = pools["flight"].pop(), _code(rng)
            subject, sender = f"Your flight to {city} is confirmed", "bookings@skyway.example"
            body = (
                f"Thank you for booking with Skyway. Flight to {city} on {date}. Confirmation code: {code}."
            )
            question, answer = f"What is the confirmation code of my flight to {city}?", code
        elif kind == "parcel":
            item, tracking = pools["parcel"].pop(), f"TRK{rng.randint(100000, 999999)}"
            subject, sender = f"Your {item} has shipped", "orders@shop.example"
            body = f"Good news: the {item} you ordered is on its way. Tracking number: {tracking}."
            question, answer = f"What is the tracking number of the {item} I ordered?", tracking
        elif kind == "meeting":
            topic, room = pools["meeting"].pop(), f"{rng.choice('ABCDE')}{rng.randint(100, 450)}"
            subject, sender = f"Room for the {topic}", rng.choice(PEOPLE)
            body = f"Hi, the {topic} meeting on {date} will be held in room {room}. See you there."
            question, answer = f"In which room is the {topic} meeting?", room
        elif kind == "invoice":
            vendor, amount = pools["invoice"].pop(), f"{rng.randint(20, 900)}.{rng.randint(0, 99):02d}"
            subject, sender = f"Invoice from {vendor}", "billing@" + vendor.split()[0].lower() + ".example"
            body = f"Dear customer, your invoice from {vendor} dated {date} is ready. Amount due: ${amount}."
            question, answer = f"How much do I owe {vendor}?", amount
        else:
            subject, body = rng.choice(NOISE)
            sender, question, answer = rng.choice(PEOPLE), None, None
        emails.append(Email(number, sender, date, subject, body))
        if question is not None:
            questions.append({"id": f"q{number}", "question": question, "answer": answer, "email_id": number})
    return emails, questions


def write_inbox(emails: list[Email], path: Path) -> None:
    """The inbox as an SQLite FTS5 table (rewritten each run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE VIRTUAL TABLE emails USING fts5(sender, date, subject, body)")
        db.executemany(
            "INSERT INTO emails (rowid, sender, date, subject, body) VALUES (?, ?, ?, ?, ?)",
            [(e.id, e.sender, e.date, e.subject, e.body) for e in emails],
        )


# The tools ------------------------------------------------------------------------------------


class ToolError(Exception):
    """A bad tool call by the model: the message goes back to it as the tool's result."""


class Inbox:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False)

    def search_emails(self, query: str) -> str:
        words = re.findall(r"\w+", str(query))
        if not words:
            raise ToolError("give a few keywords to search for")
        rows = self.db.execute(
            "SELECT rowid, sender, date, subject FROM emails WHERE emails MATCH ? ORDER BY rank LIMIT 5",
            [" OR ".join(f'"{w}"' for w in words)],
        ).fetchall()
        if not rows:
            return "No emails found."
        return "\n".join(f"id {i} | {date} | {sender} | {subject}" for i, sender, date, subject in rows)

    def read_email(self, email_id: Any) -> str:
        row = self.db.execute(
            "SELECT rowid, sender, date, subject, body FROM emails WHERE rowid = ?", [int(email_id)]
        ).fetchone()
        if row is None:
            raise ToolError(f"there is no email with id {email_id}; search first and use an id it lists")
        return "id {} | from {} | {}\nSubject: {}\n\n{}".format(*row)

    def close(self) -> None:
        self.db.close()


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind} for key, kind in properties.items()},
                "required": list(properties),
            },
        },
    }


TOOLS = [
    _tool(
        "search_emails", "Search the inbox by keywords; lists matching emails with their ids.", query="string"
    ),
    _tool("read_email", "Read one email by its id.", email_id="integer"),
    _tool(
        "answer",
        "Give the final answer and the id of the email it comes from.",
        text="string",
        email_id="integer",
    ),
]

SYSTEM = "You answer questions about the user's inbox. Search, read the right email, then call answer."


def _call(name: str, number: int, **arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{number}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _example(
    number: int, question: str, query: str, hit: str, email: str, email_id: int, text: str
) -> list[Any]:
    """One worked conversation: the 135M model calls tools only after seeing some (FACTS.md)."""
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("search_emails", number * 10, query=query)],
        },
        {"role": "tool", "tool_call_id": f"call_{number * 10}", "content": hit},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("read_email", number * 10 + 1, email_id=email_id)],
        },
        {"role": "tool", "tool_call_id": f"call_{number * 10 + 1}", "content": email},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("answer", number * 10 + 2, text=text, email_id=email_id)],
        },
        {"role": "tool", "tool_call_id": f"call_{number * 10 + 2}", "content": "Answer recorded."},
        {"role": "assistant", "content": f"The answer is {text}."},
    ]


FEW_SHOT = [
    {"role": "system", "content": SYSTEM},
    *_example(
        1,
        "What is the confirmation code of my hotel in Madrid?",
        "hotel Madrid",
        "id 901 | 2025-03-02 | stay@hotels.example | Your hotel in Madrid is booked",
        "id 901 | from stay@hotels.example | 2025-03-02\nSubject: Your hotel in Madrid is booked\n\n"
        "Your room is ready. Confirmation code: HX42LM.",
        901,
        "HX42LM",
    ),
    *_example(
        2,
        "How much do I owe Bluebird Internet?",
        "invoice Bluebird Internet",
        "id 902 | 2025-05-17 | billing@bluebird.example | Invoice from Bluebird Internet",
        "id 902 | from billing@bluebird.example | 2025-05-17\nSubject: Invoice from Bluebird Internet\n\n"
        "Your invoice is ready. Amount due: $58.10.",
        902,
        "58.10",
    ),
]


# The agent ------------------------------------------------------------------------------------


def make_agent(model: jm.Model, inbox: Inbox, args: argparse.Namespace) -> Any:
    @jm.trainable(model)
    async def search_agent(scenario: dict[str, Any], client: Any) -> float:
        """Up to ``--max-turns`` model calls; each tool call runs and its result goes back."""
        messages: list[Any] = [*FEW_SHOT, {"role": "user", "content": scenario["question"]}]
        listed: set[str] = set()  # ids the searches showed
        read: set[str] = set()
        for _ in range(args.max_turns):
            response = await client.chat.completions.create(
                messages=messages, tools=TOOLS, max_tokens=args.max_tokens, temperature=args.temperature
            )
            message = response.choices[0].message
            if not message.tool_calls:
                return grade(scenario, None, listed, read)  # prose instead of a tool call: no answer
            messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                    if call.function.name == "answer":
                        return grade(scenario, str(arguments.get("text", "")), listed, read)
                    if call.function.name == "search_emails":
                        result = inbox.search_emails(arguments["query"])
                        listed.update(re.findall(r"^id (\d+) \|", result, re.MULTILINE))
                    elif call.function.name == "read_email":
                        result = inbox.read_email(arguments["email_id"])
                        read.add(str(arguments["email_id"]))
                    else:
                        raise ToolError(f"there is no tool {call.function.name!r}")
                except (ToolError, ValueError, KeyError, TypeError, sqlite3.Error) as error:
                    result = f"{TOOL_ERROR} {type(error).__name__}: {error}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return grade(scenario, None, listed, read)

    return search_agent


TOOL_ERROR = "Error:"


def grade(scenario: dict[str, Any], answer: str | None, listed: set[str], read: set[str]) -> float:
    """1 for the right answer; else 0.2 for having read the right email, 0.1 for having found it."""
    if answer is not None and scenario["answer"].lower() in answer.lower():
        return 1.0
    email_id = str(scenario["email_id"])
    return 0.2 if email_id in read else 0.1 if email_id in listed else 0.0


def add_episode_metrics(trajectory: jm.Trajectory, scenario: dict[str, Any]) -> jm.Trajectory:
    """What the agent did (after the worked examples), read back from the captured conversation;
    ``success``: the right answer, by the known answer (a judge's score, when there is one, becomes
    the reward)."""
    own = trajectory.messages[len(FEW_SHOT) :]
    calls = [c for m in own if m.role == "assistant" for c in (m.tool_calls or [])]
    read = {
        str(_arguments(c.function.arguments).get("email_id"))
        for c in calls
        if c.function.name == "read_email"
    }
    trajectory.metrics.update(
        {
            "success": trajectory.reward == 1.0,
            "agent_tool_calls": len(calls),
            "tool_errors": sum(m.role == "tool" and str(m.content).startswith(TOOL_ERROR) for m in own),
            "read_right_email": str(scenario["email_id"]) in read,
            "answered": any(c.function.name == "answer" for c in calls),
        }
    )
    return trajectory


def _arguments(text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


RUBRICS = {
    "verdict": """\
- The agent achieved the goal only if it called answer with the exact value the user asked for (a confirmation \
code, tracking number, room or amount) as written in the email the question is about, which it read.
- An attempt that never calls answer, answers from another email, or gives a value it did not read did not achieve it.""",
    "scores": """\
- An attempt succeeds only if it calls answer with the exact value the user asked for (a confirmation code, \
tracking number, room or amount) as written in the email the question is about, which it read.
- Every success must score clearly higher than every failure; among failures, reading the right email is progress.""",
    "pairwise": """\
- An attempt that calls answer with the exact value the user asked for, as written in the email the question is \
about, is better than one that does not.
- Between two that both succeed or both fail, reading the right email and fewer wasted calls is better.""",
}
"""The task's rubric for each way of judging (``--judge-rubric task``): it says what success is."""

CRITERIA = [
    "Did the agent call read_email and get an email back in this attempt?",
    "Did the agent call answer with the value the user asked for, copied from an email it read in this attempt?",
]
"""Verdicts only (``--judge-criteria task``): yes/no questions asked one by one instead of whether the
goal was achieved; an attempt's score is the product of their P(yes)."""


async def main(args: argparse.Namespace, backend: Any = None) -> dict[str, Any]:
    """Evaluate on the held-out questions, train, evaluate again; returns what a test checks: the
    model, the questions, the loop's result (its evaluations) and the report of each step.
    ``backend``: a LocalBackend to share (default: one of its own, closed at the end). Run again,
    it goes on after the last checkpoint."""
    if backend is None:
        async with LocalBackend(root=args.root) as own:
            return await main(args, own)
    emails, questions = make_inbox(args.seed, args.inbox_size)
    if args.val_questions >= len(questions):
        raise SystemExit(
            f"--val-questions {args.val_questions} leaves no question to train on (the inbox has {len(questions)})"
        )
    train, val = (
        questions[: len(questions) - args.val_questions],
        questions[len(questions) - args.val_questions :],
    )
    write_inbox(emails, args.root / "inbox.sqlite")
    inbox = Inbox(args.root / "inbox.sqlite")
    model = jm.TrainableModel(name=args.name, project="examples", base_model=args.base_model, root=args.root)
    await model.register(backend)
    search_agent = make_agent(model, inbox, args)

    async def rollout(model: jm.TrainableModel, question: dict[str, Any]) -> jm.Trajectory:
        return add_episode_metrics(await search_agent(question), question)  # its reward: what it returned

    judge: jm.JudgeReward | None = None
    if args.judge == "ruler":
        # The base model, answered by the policy's own server, unless --judge-model names another.
        judge = jm.JudgeReward(
            await backend.judge(model, args.judge_model, explanation_max_chars=100, timeout=300),
            judge_weight=args.judge_weight, reward_weight=args.reward_weight, method=args.judge_method,
            rubric=RUBRICS[args.judge_method] if args.judge_rubric == "task" else None,
            reward_from=args.judge_reward, criteria=CRITERIA if args.judge_criteria == "task" else None,
        )  # fmt: skip
    judge_server = args.judge == "ruler" and args.judge_model not in (None, args.base_model)
    checkpointing = args.gradient_checkpointing
    if checkpointing is None:  # as the demo: on but for the 135M model with no judge server beside it
        checkpointing = args.base_model != "smollm2-135m" or judge_server
    config = jm.TrainConfig(
        learning_rate=args.learning_rate,
        scale_rewards=args.scale_rewards,
        gradient_checkpointing=checkpointing,
    )
    steps: list[Any] = []
    try:
        result = await jm.TrainingLoop(
            model,
            rollout,
            train,
            judge=judge,
            group_size=args.group_size,
            scenarios_per_step=args.questions,
            steps=args.steps,
            max_minutes=args.max_train_minutes,
            config=config,
            # Held-out success at the training temperature, by the known answers (never judged).
            evals=[jm.EvalSet("val", val, samples=args.val_samples)] if val else [],
            best_metric="val/success",
            max_exceptions=args.max_failures,
            seed=args.seed,
            on_step_end=steps.append,
        ).run()
    finally:
        inbox.close()
    return {"model": model, "inbox": emails, "questions": train, "val_questions": val,
            "result": result, "steps": steps}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--questions", type=int, default=4, help="questions per step")
    parser.add_argument("--group-size", type=int, default=8, help="attempts per question")
    parser.add_argument("--inbox-size", type=int, default=60)
    parser.add_argument("--max-turns", type=int, default=4, help="model calls per attempt")
    parser.add_argument("--max-tokens", type=int, default=96, help="longest reply per model call")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--judge", choices=["none", "ruler"], default="none")
    parser.add_argument("--max-failures", type=float, default=0.25, help="share of rollouts allowed to fail")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="email-search")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument(
        "--judge-model", help="the judge: a local model on a vLLM server of its own (default: the base model)"
    )
    parser.add_argument("--judge-method", choices=["scores", "verdict", "pairwise"], default="scores")
    parser.add_argument(
        "--judge-rubric", choices=["default", "task"], default="default",
        help="the method's general rubric, or the task's own (what a right answer is)",
    )  # fmt: skip
    parser.add_argument(
        "--judge-criteria", choices=["none", "task"], default="none",
        help="verdicts: ask the task's yes/no criteria one by one instead of whether the goal was achieved",
    )  # fmt: skip
    parser.add_argument(
        "--judge-reward", choices=["score", "rank", "best"], default="score",
        help="what the judge's part is made of: its score, the attempt's rank in its group, or 1 for the "
        "group's best attempts and 0 for the rest",
    )  # fmt: skip
    parser.add_argument(
        "--judge-weight", type=float, default=0.5, help="reward = this x the judge's score ..."
    )
    parser.add_argument(
        "--reward-weight", type=float, default=0.5, help="... + this x the known-answer reward"
    )
    parser.add_argument(
        "--scale-rewards", choices=["group", "batch", "none"], default=None,
        help="divide advantages by the group's or the batch's reward std (default: the trainer's, group)",
    )  # fmt: skip
    parser.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help="recompute activations in the backward pass: less memory, about a third more compute "
        "(default: on, but for the 135M model without a judge server of its own)",
    )  # fmt: skip
    parser.add_argument("--val-questions", type=int, default=12, help="held-out questions (the inbox's last)")
    parser.add_argument("--val-samples", type=int, default=4, help="runs per held-out question")
    parser.add_argument("--max-train-minutes", type=float, default=None, help="stop training after this long")
    parser.add_argument("--root", type=Path, default=Path(".journeyman"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
