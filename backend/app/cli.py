"""The ``journeyman`` command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from journeyman.config import LossType
from journeyman.errors import JourneymanError

from ..models import EMBEDDED_MODELS, prepare_model, prepared_folder
from .cli_runs import (
    ReportTo,
    Root,
    canary,
    checkpoints_app,
    export,
    judge_app,
    plot,
    promote,
    rollback,
    track,
    trajectories_app,
)
from .replay_cli import replay
from .sft_cli import sft

app = typer.Typer(help="journeyman: on-the-job RL for the LLM agents you already run.", no_args_is_help=True)
model_app = typer.Typer(help="Base models: list and prepare the embedded ones.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(trajectories_app, name="trajectories")
app.add_typer(judge_app, name="judge")
app.command("plot")(plot)
app.command("export")(export)
app.command("promote")(promote)
app.command("rollback")(rollback)
app.command("canary")(canary)
app.command("replay")(replay)
app.command("sft")(sft)
app.command("track")(track)
cloud_app = typer.Typer(
    help="journeyman serve on a cloud GPU with SkyPilot: launch it, ask how it is, tear it down.",
    no_args_is_help=True,
)
app.add_typer(cloud_app, name="cloud")
Cluster = Annotated[str, typer.Option(help="SkyPilot's name for the cluster.")]


@cloud_app.command("up")
def cloud_up(
    cluster: Cluster = "journeyman",
    base_model: Annotated[
        str, typer.Option(help="An embedded alias or a Hugging Face name.")
    ] = "smollm2-135m",
    gpus: Annotated[
        str | None,
        typer.Option(
            help="SkyPilot accelerators, e.g. H100:1 (default: the cheapest of L4, A10G, A100, H100)."
        ),
    ] = None,
    trainers: Annotated[
        int, typer.Option(help="Trainer processes (GPUs of the node) for data parallel training.")
    ] = 1,
    unsloth: Annotated[bool, typer.Option(help="Train with Unsloth.")] = False,
    report_to: Annotated[
        list[str] | None,
        typer.Option(help="A tracker the server writes each run to (wandb, tensorboard, mlflow)."),
    ] = None,
    autostop: Annotated[
        int | None, typer.Option(help="Minutes idle before SkyPilot stops the cluster.")
    ] = None,
    source: Annotated[
        Path | None,
        typer.Option(help="The journeyman clone the node installs (default: the one running this)."),
    ] = None,
) -> None:
    """Launch `journeyman serve` on a cloud GPU (the token from $JOURNEYMAN_TOKEN) and print its URL."""
    from .cloud import CloudServe

    serve = CloudServe(
        cluster=cluster, base_model=base_model, gpus=gpus, trainers=trainers, unsloth=unsloth,
        report_to=report_to or [], autostop=autostop, source=source,
    )  # fmt: skip
    typer.echo(f"launching {cluster} with SkyPilot (set-up takes 10-20 minutes the first time)...", err=True)
    url = serve.up()
    typer.echo(url)
    typer.echo(
        f"connect: jm.RemoteBackend({url!r}, token=os.environ['JOURNEYMAN_TOKEN']); "
        f"tear it down: journeyman cloud down --cluster {cluster}",
        err=True,
    )


@cloud_app.command("status")
def cloud_status(cluster: Cluster = "journeyman") -> None:
    """The cluster's state (UP, STOPPED, INIT, or none) and the server's URL while it is up."""
    from .cloud import CloudServe

    answer = CloudServe(cluster=cluster).status()
    typer.echo(
        f"{cluster}: {answer['status'] or 'no such cluster'}"
        + (f" {answer['endpoint']}" if answer["endpoint"] else "")
    )


@cloud_app.command("down")
def cloud_down(cluster: Cluster = "journeyman") -> None:
    """Tear the cluster down (its disk and runs with it: export or pull what you need first)."""
    from .cloud import CloudServe

    CloudServe(cluster=cluster).down()
    typer.echo(f"{cluster}: down")


@app.command("setup")
def setup(
    cuda: Annotated[
        bool | None,
        typer.Option(
            "--cuda/--cpu",
            help="vLLM for CUDA GPUs or for the CPU (default: CUDA where nvidia-smi lists a GPU).",
        ),
    ] = None,
    path: Annotated[
        Path | None,
        typer.Option(help="Where (default: $JOURNEYMAN_HOME/venvs/vllm, where journeyman looks)."),
    ] = None,
    python: Annotated[str, typer.Option(help="The Python to make it with (3.10-3.13).")] = "python3",
    dry_run: Annotated[bool, typer.Option(help="Print the commands, build nothing.")] = False,
) -> None:
    """Build the vLLM server's own environment from the versions journeyman pins (vLLM cannot share
    one with CrewAI; journeyman starts it as a subprocess). Does nothing when it is up to date."""
    from ..serving.vllm_environment import Flavor, VLLMEnvironment
    from ..settings import vllm_venv

    flavor: Flavor | None = None if cuda is None else ("cuda" if cuda else "cpu")
    environment = VLLMEnvironment.default(flavor, python, path.expanduser() if path else None)
    if dry_run:
        for command in environment.commands():
            typer.echo(" ".join(command))
        return
    environment.build(say=typer.echo)
    if environment.path != vllm_venv():
        typer.echo(f"tell journeyman where it is: export JOURNEYMAN_VLLM_PYTHON={environment.venv_python}")


@model_app.command("prepare")
def model_prepare(
    name: Annotated[
        str, typer.Argument(help=f"Embedded model alias: {', '.join(EMBEDDED_MODELS)}.")
    ] = "smollm2-135m",
    cache_dir: Annotated[
        Path | None, typer.Option(help="Folder for converted models (default: $JOURNEYMAN_HOME/models).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Convert again even when a matching folder exists.")] = False,
) -> None:
    """Assemble, check and convert an embedded model into a Hugging Face folder (once; later runs
    do nothing). Prints the folder."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = prepare_model(name, cache_dir, force=force)
    typer.echo(str(folder))


@model_app.command("list")
def model_list(
    cache_dir: Annotated[
        Path | None, typer.Option(help="Folder for converted models (default: $JOURNEYMAN_HOME/models).")
    ] = None,
) -> None:
    """Every embedded model: its size, licence, and whether it is prepared (and where)."""
    table = Table("alias", "model", "GGUF", "wheels", "licence")
    table.add_column("prepared", overflow="fold")
    for alias, model in EMBEDDED_MODELS.items():
        folder = prepared_folder(alias, cache_dir)
        table.add_row(
            alias, model.description.partition(" (")[0], f"{model.size / 1e6:,.0f} MB", str(len(model.parts)),
            model.licence, escape(str(folder)) if folder else "no",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)


# The GPU options `serve` and `demo` share
GpuShare = Annotated[
    float | None,
    typer.Option(
        min=0.01,
        max=1.0,
        help="CUDA: the share of the GPU the policy's vLLM server takes (default: planned from the models' "
        "sizes, beside a judge's server and the trainer).",
    ),
]
SleepMode = Annotated[
    bool,
    typer.Option(
        "--sleep-mode/--no-sleep-mode",
        help="CUDA: the policy's vLLM server sleeps while the trainer steps, leaving it the memory "
        "(requests wait meanwhile).",
    ),
]
TrainDevice = Annotated[
    str,
    typer.Option(
        help="Where the trainer trains: auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."
    ),
]


@app.command("serve")
def serve(
    host: Annotated[
        str, typer.Option(help="Address to bind; beyond loopback a token is required.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    token: Annotated[
        str | None, typer.Option(envvar="JOURNEYMAN_TOKEN", help="Bearer token clients must send.")
    ] = None,
    root: Root = None,
    push_to: Annotated[
        list[str] | None,
        typer.Option(help="Also deploy each trained step to this remote `journeyman serve` (repeatable)."),
    ] = None,
    push_token: Annotated[
        str | None,
        typer.Option(envvar="JOURNEYMAN_PUSH_TOKEN", help="Bearer token of the --push-to servers."),
    ] = None,
    tensor_parallel: Annotated[int, typer.Option(help="vLLM --tensor-parallel-size (GPUs per replica).")] = 1,
    data_parallel: Annotated[int, typer.Option(help="vLLM --data-parallel-size (engine copies).")] = 1,
    gpu_memory_utilization: GpuShare = None,
    sleep_mode: SleepMode = False,
    train_device: TrainDevice = "auto",
    merge_adapters: Annotated[
        bool,
        typer.Option(
            help="Serve each trained step merged into vLLM's weights (one trained model; faster on CPU)."
        ),
    ] = False,
    replicas: Annotated[
        int, typer.Option(help="vLLM replicas behind the gateway, each rollout sticking to one.")
    ] = 1,
    inference: Annotated[
        bool,
        typer.Option(
            help="Serve rollouts here; --no-inference only trains and pushes each step to --push-to."
        ),
    ] = True,
    fsdp: Annotated[
        bool,
        typer.Option(help="Under torchrun: shard the base model's layers across the ranks (FSDP2)."),
    ] = False,
    report_to: ReportTo = None,
) -> None:
    """Serve and train models over HTTP (the client is jm.RemoteBackend); the gateway is under /v1.

    Under ``torchrun --nproc-per-node N -m journeyman.backend serve ...`` the trainer is data
    parallel: rank 0 serves, the other ranks train their share of each step. With ``--fsdp`` the
    ranks also split the base model's layers between them, for a model one process cannot hold.
    """
    import functools
    import os

    import uvicorn

    from ..local import LocalBackend
    from ..serving.adapters import AdapterPush
    from ..serving.vllm import VLLMConfig
    from .server import check_bind, create_app

    check_bind(host, token)
    options: dict[str, Any] = {}
    if fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise typer.BadParameter(
            "--fsdp shards across ranks: launch with torchrun --nproc-per-node 2 or more"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ..training.distributed import LeaderTrainer, follow, init_distributed

        rank, _ = init_distributed("cuda" if train_device.startswith("cuda") else train_device)
        if rank != 0:
            follow()
            return
        options["trainer_class"] = functools.partial(LeaderTrainer, fsdp=fsdp)
    if tensor_parallel != 1 or data_parallel != 1 or gpu_memory_utilization is not None:
        options["vllm"] = VLLMConfig(
            model="", tensor_parallel_size=tensor_parallel, data_parallel_size=data_parallel,
            gpu_memory_utilization=gpu_memory_utilization,
        )  # fmt: skip
    push = AdapterPush(push_to, push_token) if push_to else None
    backend = LocalBackend(
        root=root, gateway_thread=False, push_to=push, merge_adapters=merge_adapters, replicas=replicas,
        inference=inference, sleep_mode=sleep_mode, train_device=train_device, **options,
    )  # fmt: skip
    from journeyman.trackers import default_report_to, make_trackers

    trackers = default_report_to() if report_to is None else report_to
    make_trackers(trackers)  # an unknown name fails now, not at the first step
    uvicorn.run(create_app(backend, token, report_to=trackers), host=host, port=port, log_level="info")


@app.command("ui")
def ui(
    root: Root = None,
    host: Annotated[
        str, typer.Option(help="Address to bind; beyond loopback a token is required.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="JOURNEYMAN_TOKEN", help="Token a browser signs in with once (a form; never a URL)."
        ),
    ] = None,
) -> None:
    """A read-only web viewer over a run store: runs, live curves, groups side by side, tokens."""
    import uvicorn

    from journeyman.store import default_root

    from .binding import check_bind
    from .ui.app import Viewer

    check_bind(host, token, "read every stored trajectory")
    folder = root or default_root()
    typer.echo(f"journeyman ui: {folder} at http://{host}:{port}/ (Ctrl-C stops it)")
    uvicorn.run(Viewer(folder, token=token).app, host=host, port=port, log_level="warning")


@app.command("demo")
def demo(
    steps: Annotated[
        int, typer.Option(help="Training steps (the time limit usually ends the run first).")
    ] = 100,
    max_train_minutes: Annotated[
        float | None, typer.Option(help="Stop training after this many minutes (then evaluate).")
    ] = 30.0,
    scenarios_per_step: Annotated[
        int, typer.Option(help="Questions per step (half sums, half products).")
    ] = 4,
    group_size: Annotated[int, typer.Option(help="Rollouts per question (a GRPO group).")] = 8,
    train_scenarios: Annotated[int, typer.Option(help="Training questions (generated from the seed).")] = 256,
    val_scenarios: Annotated[int, typer.Option(help="Held-out questions.")] = 40,
    val_samples: Annotated[
        int, typer.Option(help="Samples per held-out question at the training temperature.")
    ] = 4,
    temperature: Annotated[float, typer.Option(help="Sampling temperature for training rollouts.")] = 0.7,
    max_tokens: Annotated[int, typer.Option(help="Longest model turn, in tokens.")] = 48,
    learning_rate: Annotated[float, typer.Option(help="LoRA learning rate.")] = 5e-4,
    loss: Annotated[str, typer.Option(help=", ".join(get_args(LossType)) + ".")] = "dapo",
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 8,
    gradient_checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--gradient-checkpointing/--no-gradient-checkpointing",
            help="Recompute activations in the backward pass (default: on for models other than smollm2-135m).",
        ),
    ] = None,
    shaping: Annotated[
        float, typer.Option(help="Reward for the right tool call when the answer is wrong.")
    ] = 0.0,
    judge: Annotated[
        str, typer.Option(help="none, or ruler: an LLM judge ranks each group and its score is the reward.")
    ] = "none",
    judge_model: Annotated[
        str | None,
        typer.Option(
            help="The judge: a local model on a vLLM server of its own (an alias, a folder; the policy's own base "
            "model is answered by the policy's server), or with --judge-base-url the model that endpoint serves "
            "(default: qwen2.5-coder-1.5b, locally)."
        ),
    ] = None,
    judge_method: Annotated[
        str,
        typer.Option(
            help="verdict (P(yes) per trajectory), scores (RULER: the group in one prompt) or pairwise "
            "(every pair in both orders)."
        ),
    ] = "verdict",
    judge_anyway: Annotated[
        bool, typer.Option(help="Train with a judge that ranks the first step no better than chance.")
    ] = False,
    judge_reward: Annotated[
        str,
        typer.Option(
            help="What the reward is made of: 1 for the group's best attempts by the judge's score and 0 for the "
            "rest (best), each attempt's rank in its group (rank), or the judge's score (score)."
        ),
    ] = "best",
    judge_reference: Annotated[
        bool,
        typer.Option(
            help="The judge first writes how each question should be done, then checks the attempts against it."
        ),
    ] = False,
    judge_base_url: Annotated[
        str | None,
        typer.Option(
            help="OpenAI-compatible endpoint of the judge (key: $JOURNEYMAN_JUDGE_API_KEY or $OPENAI_API_KEY)."
        ),
    ] = None,
    reward_weight: Annotated[
        float, typer.Option(help="With a judge: reward = judge score + this x the programmatic reward.")
    ] = 0.0,
    scale_rewards: Annotated[
        str | None,
        typer.Option(help="Divide advantages by the group's reward std (the default), the batch's, or none."),
    ] = None,
    langfuse: Annotated[
        bool, typer.Option(help="Export every trajectory to Langfuse (LANGFUSE_* keys).")
    ] = False,
    report_to: ReportTo = None,
    zero_shot_eval: Annotated[
        bool, typer.Option(help="Also evaluate with no worked examples in the prompt.")
    ] = True,
    tool_seconds: Annotated[
        float, typer.Option(help="Each tool call waits this long first, as real agents wait on APIs.")
    ] = 0.0,
    vllm_cores: Annotated[
        str | None,
        typer.Option(help="CPU: cores for the policy's vLLM server, e.g. 1 or 0-3 (default: all)."),
    ] = None,
    trainer_threads: Annotated[
        int | None, typer.Option(help="CPU: the trainer's torch threads (default: one per core).")
    ] = None,
    max_steps_off_policy: Annotated[
        int,
        typer.Option(
            help="Sample up to this many later steps while a step trains (0: sample, then train, in turn)."
        ),
    ] = 0,
    seed: Annotated[int, typer.Option(help="Seed for the questions, each rollout's sampling, training.")] = 0,
    sampling_seed: Annotated[
        int | None, typer.Option(help="Seed for the rollouts' sampling alone (default: --seed).")
    ] = None,
    merge_adapters: Annotated[
        bool | None,
        typer.Option(
            "--merge-adapters/--no-merge-adapters",
            help="Serve each step merged into vLLM's weights (about 2x faster rollouts on CPU; default: only "
            "for smollm2-135m: a merging server compiles its graphs at every start, 6 minutes for the 0.5B).",
        ),
    ] = None,
    serving_dtype: Annotated[
        str,
        typer.Option(
            help="vLLM's --dtype (auto, bfloat16, float16, float32). float32 is slower, but on CPU a seeded "
            "request samples the same tokens and logprobs in any batch, however its prompt is split."
        ),
    ] = "auto",
    gpu_memory_utilization: GpuShare = None,
    sleep_mode: SleepMode = False,
    train_device: TrainDevice = "auto",
    name: Annotated[str | None, typer.Option(help="Model name (default: a fresh calc-<time>).")] = None,
    model: Annotated[
        str,
        typer.Option(help=f"Base model: {', '.join(EMBEDDED_MODELS)}, a Hugging Face folder or a hub name."),
    ] = "smollm2-135m",
    worked_examples: Annotated[
        bool | None,
        typer.Option(
            "--worked-examples/--no-worked-examples",
            help="Train with four worked examples in every prompt, or in none (--worked-share 1 or 0).",
        ),
    ] = None,
    worked_share: Annotated[
        float | None,
        typer.Option(
            help="Share of each step's groups with the worked examples, the rest zero-shot (default: 0 after a "
            "warm start; 1 for smollm2-135m, which needs them; 0.5 for other models).",
        ),
    ] = None,
    warm_start: Annotated[
        str,
        typer.Option(
            help="sft: first collect the training questions' successes with the worked examples and teach them "
            "under the zero-shot prompt (a supervised step), then train zero-shot. none: RL only.",
        ),
    ] = "none",
    warm_start_samples: Annotated[
        int, typer.Option(help="Attempts per training question when collecting the warm start's data.")
    ] = 2,
    warm_start_epochs: Annotated[int, typer.Option(help="Epochs of the warm start's supervised run.")] = 2,
    root: Root = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Go on with an interrupted run: its folder (ROOT/demo/NAME, printed at the start). It continues "
            "at the step after its latest checkpoint with the run's own settings (the other options are ignored).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
) -> None:
    """Teach the embedded model a LangGraph calculator task on this machine, before/after evaluation included."""
    from .demo import DemoConfig, resume_config, run_demo

    if resume is not None:
        run_demo(resume_config(resume), resume=True)
        return

    if worked_examples is not None and worked_share is not None:
        raise typer.BadParameter("give --worked-examples/--no-worked-examples or --worked-share, not both")
    if worked_examples is not None:
        worked_share = 1.0 if worked_examples else 0.0
    config = DemoConfig(
        steps=steps, max_train_minutes=max_train_minutes, scenarios_per_step=scenarios_per_step, group_size=group_size,
        train_scenarios=train_scenarios, val_scenarios=val_scenarios, val_samples=val_samples,
        temperature=temperature, max_tokens=max_tokens, learning_rate=learning_rate, loss=loss,  # type: ignore[arg-type]
        rank=rank, gradient_checkpointing=gradient_checkpointing, shaping=shaping, judge=judge, judge_model=judge_model, judge_base_url=judge_base_url,  # type: ignore[arg-type]
        judge_method=judge_method, judge_anyway=judge_anyway, judge_reference=judge_reference,  # type: ignore[arg-type]
        judge_reward=judge_reward,  # type: ignore[arg-type]
        reward_weight=reward_weight, scale_rewards=scale_rewards, langfuse=langfuse, zero_shot_eval=zero_shot_eval,  # type: ignore[arg-type]
        report_to=None if report_to is None else tuple(report_to),
        seed=seed, sampling_seed=sampling_seed, merge_adapters=merge_adapters, name=name, root=root, base_model=model,
        worked_share=worked_share, serving_dtype=serving_dtype, gpu_memory_utilization=gpu_memory_utilization,
        sleep_mode=sleep_mode, train_device=train_device, max_steps_off_policy=max_steps_off_policy,
        tool_seconds=tool_seconds, vllm_cores=vllm_cores, trainer_threads=trainer_threads,
        warm_start=warm_start, warm_start_samples=warm_start_samples, warm_start_epochs=warm_start_epochs,
    )  # fmt: skip
    run_demo(config)


@app.command("check")
def check(
    run_dir: Annotated[
        Path, typer.Argument(help="The run's folder: ROOT/PROJECT/NAME.", exists=True, file_okay=False)
    ],
    records: Annotated[
        Path | None, typer.Option(help="The gateway's records (default: ROOT/gateway/completions.jsonl).")
    ] = None,
    on_policy: Annotated[
        bool,
        typer.Option(
            "--on-policy",
            help="Each step trained only on turns its own version answered (runs that sample, then train, "
            "like the demo); without it such turns are counted, not faults.",
        ),
    ] = False,
    max_off_policy: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Each step trained only on turns at most K versions older than its own (a run whose "
            "rollouts overlap training by K steps); --on-policy is K = 0.",
        ),
    ] = None,
) -> None:
    """Check a run's files after an interruption: checkpoints, history, trajectories, records."""
    from journeyman.run_check import check_run

    result = check_run(run_dir, records, on_policy=on_policy, max_off_policy=max_off_policy)
    typer.echo(
        f"{result.run_dir}: latest checkpoint {result.latest_step}, {result.trained_steps} steps in the history, "
        f"{result.trained_groups} groups trained, {result.records} records, "
        f"{result.stale_turns} trained turns answered by an older version than their step's "
        f"(at most {result.most_off_policy} behind), "
        f"{result.hidden_leftovers} hidden leftovers of killed writes"
    )
    if result.unfinished_step is not None:
        typer.echo(f"step {result.unfinished_step} was stored but not trained (the run stopped during it)")
    for problem in result.problems:
        typer.echo(f"problem: {problem}", err=True)
    typer.echo("every promise holds" if result.ok else f"{len(result.problems)} problem(s)")
    raise typer.Exit(0 if result.ok else 1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except JourneymanError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise SystemExit(1) from None
