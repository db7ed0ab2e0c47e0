"""Tic-tac-toe against a scripted opponent, trained with @jm.trainable.

The agent is a plain OpenAI-SDK function: it sees the board, names a cell, and the opponent
answers. The function returns the reward (win 1, draw 0.5, loss 0, forfeit -1); `@jm.trainable`
captures every model call of a game, token-exact, as one multi-turn trajectory.

    python examples/tic_tac_toe/tic_tac_toe.py                     # 10 steps, groups of 8
    python examples/tic_tac_toe/tic_tac_toe.py --steps 1 --group-size 2 --games 2   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman.backend import LocalBackend

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
REWARDS = {"win": 1.0, "draw": 0.5, "loss": 0.0, "forfeit": -1.0}
ILLEGAL = "Illegal move"
SYSTEM = (
    "You play tic-tac-toe as X. Cells are numbered 1 to 9, left to right, top to bottom. "
    "On your turn, reply with the number of one empty cell and nothing else."
)


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    cells = [mark if mark != " " else str(i + 1) for i, mark in enumerate(board)]
    return "\n---------\n".join(" | ".join(cells[row : row + 3]) for row in (0, 3, 6))


def opponent_move(board: list[str], rng: random.Random, skill: float) -> int:
    """Win if it can; block X with probability ``skill``; else a random empty cell."""
    empty = [i for i, mark in enumerate(board) if mark == " "]
    for mark in ("O", "X"):
        if mark == "X" and rng.random() > skill:
            break
        for cell in empty:
            trial = board.copy()
            trial[cell] = mark
            if winner(trial) == mark:
                return cell
    return rng.choice(empty)


def parse_move(text: str) -> int | None:
    """The first digit 1-9 in the reply, as a cell index; None when there is none."""
    match = re.search(r"[1-9]", text)
    return int(match.group()) - 1 if match else None


def scenarios(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": f"game-{i}", "seed": rng.randrange(2**31), "x_first": i % 2 == 0} for i in range(count)]


def make_agent(model: jm.Model, args: argparse.Namespace) -> Any:
    @jm.trainable(model)
    async def play(scenario: dict[str, Any], client: Any) -> float:
        """One game; returns its reward. An illegal move is explained and the model asked again;
        more than ``--max-illegal`` of them forfeit the game."""
        rng = random.Random(scenario["seed"])
        board = [" "] * 9
        if not scenario["x_first"]:
            board[opponent_move(board, rng, args.skill)] = "O"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{render(board)}\n\nYour move."},
        ]
        illegal = 0
        while True:
            response = await client.chat.completions.create(
                messages=messages, max_tokens=args.max_tokens, temperature=args.temperature
            )
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            cell = parse_move(reply)
            if cell is None or board[cell] != " ":
                illegal += 1
                if illegal > args.max_illegal:
                    return REWARDS["forfeit"]
                why = "no cell number" if cell is None else f"cell {cell + 1} is taken"
                messages.append(
                    {"role": "user", "content": f"{ILLEGAL}: {why}.\n\n{render(board)}\n\nYour move."}
                )
                continue
            board[cell] = "X"
            if winner(board) == "X":
                return REWARDS["win"]
            if " " not in board:
                return REWARDS["draw"]
            board[opponent_move(board, rng, args.skill)] = "O"
            if winner(board) == "O":
                return REWARDS["loss"]
            if " " not in board:
                return REWARDS["draw"]
            messages.append({"role": "user", "content": f"{render(board)}\n\nYour move."})

    return play


def add_game_metrics(trajectory: jm.Trajectory) -> jm.Trajectory:
    """Outcome and illegal moves, read back from the captured game (a forfeit's last illegal
    move got no answer)."""
    outcome = {reward: name for name, reward in REWARDS.items()}[trajectory.reward]  # type: ignore[index]
    told = sum(m.role == "user" and str(m.content).startswith(ILLEGAL) for m in trajectory.messages)
    trajectory.metadata["outcome"] = outcome
    trajectory.metrics["illegal_moves"] = told + (outcome == "forfeit")
    for name in REWARDS:
        trajectory.metrics[name] = outcome == name
    return trajectory


async def main(args: argparse.Namespace, backend: Any = None) -> dict[str, Any]:
    """Train; returns what a test checks: the model, the loop's result and the report of each step.
    ``backend``: a LocalBackend to share (default: one of its own, closed at the end). Run again,
    it goes on after the last checkpoint."""
    if backend is None:
        async with LocalBackend(root=args.root) as own:
            return await main(args, own)
    model = jm.TrainableModel(name=args.name, project="examples", base_model=args.base_model, root=args.root)
    await model.register(backend)
    play = make_agent(model, args)

    async def rollout(model: jm.TrainableModel, game: dict[str, Any]) -> jm.Trajectory:
        return add_game_metrics(await play(game))  # the game's reward is what `play` returned

    steps: list[Any] = []
    result = await jm.TrainingLoop(
        model,
        rollout,
        scenarios(args.games, args.seed),
        group_size=args.group_size,
        scenarios_per_step=args.games,  # every game, every step
        steps=args.steps,
        config=jm.TrainConfig(learning_rate=args.learning_rate),
        max_exceptions=args.max_failures,
        seed=args.seed,
        on_step_end=steps.append,
    ).run()
    return {"model": model, "result": result, "steps": steps}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--games", type=int, default=4, help="scenarios (opponent seeds), played every step")
    parser.add_argument("--group-size", type=int, default=8, help="games per scenario")
    parser.add_argument("--max-tokens", type=int, default=8, help="longest reply per move")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--skill", type=float, default=0.5, help="chance the opponent blocks a winning line")
    parser.add_argument("--max-illegal", type=int, default=1, help="illegal moves allowed before a forfeit")
    parser.add_argument("--max-failures", type=float, default=0.25, help="share of rollouts allowed to fail")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="tic-tac-toe")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--root", type=Path, default=Path(".journeyman"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
