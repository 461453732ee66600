"""The typed configuration tree of a megatron-sao run.

Every field is documented by the string under it; `sao config describe` prints these. Recipes
(`recipes/*.yaml`) set a subset; dotted CLI overrides (`actor.lr=2e-6`) set the rest. Defaults are
the paper's settings for Qwen3-30B-A3B math-with-Python where the paper gives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True)
class RunConfig:
    name: str = "sao"
    """Run name: the run directory is `output_dir/name`, and the wandb run name."""
    output_dir: str = "runs"
    """Parent directory of run directories (resolved config, logs, checkpoints unless set)."""
    seed: int = 1234
    """Seed for model init, data order and sampling."""
    total_steps: int = 1000
    """Train steps to run (one batch each; critic-warmup steps included). May be raised when a
    run resumes."""
    max_consecutive_skipped_steps: int = 5
    """Abort after this many consecutive train steps were skipped for a non-finite loss or
    gradient norm (a skipped step changes no parameter and no optimizer state)."""


@dataclass(kw_only=True)
class ModelConfig:
    hf_path: str = ""
    """HuggingFace checkpoint directory the actor and critic start from (config, tokenizer,
    safetensors). In a recipe, a relative path is relative to the recipe file."""
    build_tiny: bool = False
    """Build a tiny random checkpoint at `hf_path` if none is there (CPU demo and tests). The
    architecture overrides below then define its shape."""
    tiny_family: str = "qwen3_moe"
    """Model family of the tiny checkpoint (see megatron_sao.models.tiny_hf.supported_families)."""
    load_weights: bool = True
    """Load the checkpoint's weights (False: random init with the checkpoint's architecture)."""
    dtype: Dtype = "bfloat16"
    """Parameter / compute dtype. CPU runs use float32."""
    num_layers: int | None = None
    """Architecture override: number of transformer layers (None keeps the checkpoint's)."""
    hidden_size: int | None = None
    """Architecture override: hidden size."""
    num_attention_heads: int | None = None
    """Architecture override: attention heads."""
    num_query_groups: int | None = None
    """Architecture override: key/value heads (GQA groups)."""
    num_experts: int | None = None
    """Architecture override: routed experts per MoE layer."""
    moe_router_topk: int | None = None
    """Architecture override: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Architecture override: expert FFN hidden size."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron MoE token dispatcher."""
    moe_aux_loss_coeff: float = 0.0
    """Router load-balancing loss coefficient (RL usually leaves routing to the SFT model)."""
    moe_grouped_gemm: bool = True
    """Use grouped GEMM for experts (GPU only; forced off on CPU)."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    provider_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra attributes set on megatron-bridge's model provider (an escape hatch; unknown
    attribute names are rejected when the model is built)."""


@dataclass(kw_only=True)
class ParallelismConfig:
    tensor: int = 1
    """Tensor-parallel size (TP)."""
    pipeline: int = 1
    """Pipeline-parallel size (PP)."""
    virtual_pipeline: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); None disables."""
    expert: int = 1
    """Expert-parallel size (EP)."""
    expert_tensor: int | None = None
    """Expert tensor-parallel size (ETP); None means equal to `tensor`."""
    context: int = 1
    """Context-parallel size (CP): each sequence split into 2 x CP chunks, rank r holding chunks
    r and 2 CP - 1 - r (Megatron's load-balanced causal layout); for long trajectories."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] | None = None
    """How attention exchanges keys/values under CP on GPU (Transformer Engine's `cp_comm_type`):
    p2p (ring, overlapped with compute), all_gather, a2a (Ulysses: heads scattered over CP),
    a2a+p2p (hierarchical). None: p2p, or all_gather for GLM-5's sparse attention (DSA), the only
    one it supports. The CPU attention always all-gathers (docs/training.md)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; None turns it on whenever tensor > 1 (required with MoE)."""
    world_size: int | None = None
    """Trainer processes per role. None: taken from the launcher (nnodes x nproc_per_node)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    lr_warmup_steps: int = 0
    """Linear warmup steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (Megatron distributed optimizer)."""


@dataclass(kw_only=True)
class RoleConfig:
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer of this role."""
    trainable: list[str] = field(default_factory=lambda: ["all"])
    """Parameter groups that train: any of all, attention, experts, router, shared_experts,
    dense_mlp, embedding, norms, head; or `re:<regex>` over Megatron parameter names."""
    frozen: list[str] = field(default_factory=list)
    """Groups (same vocabulary) frozen even when listed in `trainable` (frozen wins)."""
    micro_batch_size: int = 1
    """Trajectories per forward/backward micro-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch, padding included (rows x padded length). Trajectories of
    similar length are bucketed together up to this budget (at most `micro_batch_size` rows when
    None). A trajectory longer than the budget gets a micro-batch of its own."""
    load: str = ""
    """Megatron checkpoint to start this role from instead of the HF weights: a run's
    `checkpoints/` directory (its latest iteration), one `iter_NNNNNNN/` directory, or a
    `sao convert hf-to-mcore` output. Weights only: optimizer and schedule start fresh."""


@dataclass(kw_only=True)
class ActorConfig(RoleConfig):
    """The policy. Trains every parameter group by default (paper)."""

    num_mini_batches: int = 1
    """Actor optimizer steps per batch: the batch is split into this many mini-batches
    (paper SAO: 1). The actor's LR schedule counts these optimizer steps."""
    routing_replay: bool | None = None
    """R3 routing replay: the actor's forwards (DIS log-probs and the update) route every token to
    the experts the rollout engine chose for it (`Trajectory.routed_experts`, engines started with
    `--enable-return-routed-experts`) through Megatron-Core's router replay; tokens without
    recorded routing use the actor's own router (counted: `moe/replay_missing_frac`). The critic
    always routes itself. null (default): on for an MoE model with `rollout.source=engine`; with
    `rollout.source=recorded`, on when the file's records carry routing (the tiny recorded
    demo's do not); off for a dense model. `sao sft` never replays."""
    logits_chunk_tokens: int | None = 2048
    """Tokens (rows x positions of a micro-batch, per CP rank) whose vocabulary logits are
    computed at once for log-probs, entropy and the SFT loss; each chunk is recomputed in the
    backward, so `tokens x vocab` logits never exist at once. None: all tokens of a micro-batch
    at once (no recomputation)."""


@dataclass(kw_only=True)
class CriticConfig(RoleConfig):
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    """Optimizer of the critic (paper: lr 5e-6, 5x the actor's)."""
    trainable: list[str] = field(default_factory=lambda: ["all"])
    """Critic parameter groups that train."""
    frozen: list[str] = field(default_factory=lambda: ["attention"])
    """Critic groups kept frozen (paper: attention frozen during RL)."""
    updates_per_actor_step: int = 2
    """K: critic optimizer steps per actor step, on the same batch (paper: 2)."""
    warmup_steps: int = 10
    """First steps that update only the critic (paper: 10)."""
    value_clip: float | None = None
    """PPO-style value clipping range around rollout-time values (None: plain MSE)."""
    value_head_init_std: float = 0.02
    """Std of the value head's initialisation when the checkpoint has none."""
    ev_min_return_var: float = 1e-3
    """Diagnostics: `critic/explained_variance` is NaN (not reported; plots skip it, and
    `critic/explained_variance_nan_steps` counts the steps) when the batch's return variance is at
    most this: nearly constant returns say nothing about the critic (one failure among 31
    successes makes any EV from -30 to 1). 0: only round-off of a constant."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage: Literal["gae", "grpo", "running_mean", "step_level"] = "gae"
    """Advantage estimator: SAO's skip-observation GAE, or an ablation baseline."""
    policy_loss: Literal["dis", "ppo_clip"] = "dis"
    """Policy loss: DIS (double-sided token mask, rollout log-probs) or PPO clip (GRPO runs)."""
    eps_low: float = 0.3
    """DIS band lower edge: tokens with rho <= 1 - eps_low are masked (paper math: 0.3)."""
    eps_high: float = 5.0
    """DIS band upper edge: tokens with rho >= 1 + eps_high are masked (paper math: 5.0)."""
    clip_low: float = 0.2
    """PPO clip lower range (GRPO baselines)."""
    clip_high: float = 0.28
    """PPO clip upper range (clip-higher)."""
    gamma: float = 1.0
    """Discount over action tokens."""
    lambda_policy: float | None = None
    """GAE lambda for policy advantages; None: length-adaptive 1 - 1/(alpha * l)."""
    lambda_alpha: float = 1.5
    """alpha of the length-adaptive lambda."""
    lambda_critic: float = 1.0
    """GAE lambda for value targets."""
    advantage_norm: Literal["none", "mean", "whiten"] = "none"
    """Critic-based advantages (gae, step_level) of a batch before the actor sees them: as computed,
    minus their mean over the batch's action tokens (`mean`), or also divided by their std
    (`whiten`, as PPO implementations do). The paper does not say; docs/pipeline.md has the
    measurements that chose the embedded default's setting."""
    bootstrap_truncated: bool = False
    """Bootstrap truncated trajectories from V at their end instead of treating them terminal."""
    group_size: int = 1
    """Responses per prompt: 1 for SAO; 8 for GRPO baselines."""
    grpo_normalize_std: bool = True
    """GRPO: divide by the group's reward std."""
    running_mean_window: int = 8
    """Running-mean baseline window (rewards per prompt; or global when running_mean_scope=global)."""
    running_mean_scope: Literal["prompt", "global"] = "prompt"
    """Running-mean baseline scope."""
    step_level_mode: Literal["average", "last"] = "average"
    """Step-level advantage: a turn's value is the average or the last token's value."""
    max_staleness: int = 4
    """Largest actor_version - policy_version a token may have to be trained on."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """ppo_clip only: the behaviour log-probs of the PPO ratio, recomputed by the actor before
    its update (synchronous GRPO) or the rollout engine's. DIS always uses the engine's."""


@dataclass(kw_only=True)
class SGLangConfig:
    tensor: int = 1
    """SGLang --tp-size per engine."""
    expert: int = 1
    """SGLang --ep-size per engine."""
    data: int = 1
    """DP attention per engine: SGLang --attn-dp-size (0.5.23's spelling of --dp-size N
    --enable-dp-attention; the engine stays one replica, --dp-size 1, as weight updates require);
    must divide `tensor`."""
    mem_fraction_static: float = 0.7
    """SGLang --mem-fraction-static."""
    extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` arguments, verbatim."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Actor -> engine weight updates (`pipeline/weight_sync.py` reads it, mode resolved)."""

    mode: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    """How new actor weights reach the engines: tensors sent to each engine (colocated; SGLang gets
    CUDA IPC handles of trainer rank 0's GPU, so its engines must be on rank 0's node), a process
    group between trainer rank 0 and the engines (disaggregated; NCCL on GPU, gloo on CPU), or
    safetensors files the engines load (fallback). auto: tensor for colocated SGLang engines and
    for CPU engines, distributed for disaggregated SGLang engines (config/placement.py)."""
    bucket_mb: float = 512.0
    """Weights travel in buckets of at most this many MiB (peak extra memory of a sync; one tensor
    bigger than that is a bucket of its own)."""
    every_n_steps: int = 1
    """Sync after every N actor updates (engines then sample from a policy up to N - 1 versions
    old; DIS corrects for it)."""
    checksum: bool = False
    """Debugging: compare a checksum of the exported weights with what went on the wire (decoded
    back on the sender; engines report no hash of what they loaded)."""
    master_address: str = ""
    """Distributed mode: the address at which the engines reach trainer rank 0 ('': MASTER_ADDR,
    where rank 0 hosts torch.distributed's store, reachable from every node)."""


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["cpu", "sglang"] = "sglang"
    """Rollout engine: SGLang servers (GPU) or the project's CPU engine speaking SGLang's protocol."""
    num_engines: int = 1
    """Engine servers to run."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options."""
    environment: str = "math_python"
    """Environment name (registered: `config/rollout_names.py`; an unknown name's error lists them)
    or `module:attribute`; checked when the config loads."""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the environment (its builder's keyword arguments, e.g. `calc`'s CalcConfig
    fields); they override what is derived from the keys below."""
    reward: str = "math"
    """Reward function (registered: exact_match, math, remote) or `module:function`, for
    environments that score with one (math_python); environments that score themselves (calc)
    do not read it. Checked when the config loads."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    max_turns: int = 50
    """Assistant turns before a trajectory is truncated (paper math: 50, SWE: 300)."""
    max_new_tokens_per_turn: int = 8192
    """Tokens one assistant turn may generate."""
    max_total_tokens: int = 131072
    """Context budget of a whole trajectory (prompt + actions + observations)."""
    source: Literal["engine", "recorded"] = "engine"
    """Where trajectories come from: rollout engines (the asynchronous pipeline), or a recorded
    file (`data.trajectories_path`, Parquet or JSONL of the trajectory record) read in file order
    without starting any engine."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Actor -> engine weight updates."""
    max_inflight_per_engine: int = 64
    """Trajectories generating concurrently on one engine."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed tool call (math_python's `timeout_s`)."""
    tool_memory_mb: int = 1024
    """Memory limit of one sandboxed tool call (math_python's `memory_mb`)."""


@dataclass(kw_only=True)
class PipelineConfig:
    staleness_check: Literal["token", "trajectory"] = "token"
    """Staleness of a trajectory: that of its oldest action token, or of its last one."""
    stale_policy: Literal["drop", "keep"] = "drop"
    """A trajectory staler than algorithm.max_staleness is dropped (counted), or kept and trained
    on (counted; DIS masks its tokens whose ratio left the band)."""
    max_buffered: int | None = None
    """Back-pressure: no new prompt starts while the ready buffer holds this many trajectories
    (None: 2 x data.batch_size)."""
    distinct_prompts: bool = True
    """A batch holds at most one trajectory (group) per prompt."""
    barrier: bool = False
    """Synchronous rounds, for baselines (sync GRPO / sync single-rollout, `tools/bench_async.py`):
    a round of `data.batch_size` trajectories starts generating only when the trainer asks for a
    batch, and the trainer waits for all of it. False: SAO's asynchronous buffer."""
    engine_health_interval_s: float = 5.0
    """Seconds between health checks of each running engine."""
    engine_health_timeout_s: float = 10.0
    """A health check unanswered for this long fails."""
    engine_health_failures: int = 3
    """An engine whose process is alive but fails this many checks in a row is hung: it is killed,
    restarted by the engine supervisor, and its in-flight calls go to a healthy engine."""


@dataclass(kw_only=True)
class DataConfig:
    train_path: str = ""
    """Prompt dataset (JSONL or Parquet; schema in docs/datasets-and-environments.md). In a
    recipe, a relative path is relative to the recipe file."""
    max_prompt_chars: int = 32768
    """Longer prompts are skipped and counted."""
    batch_size: int = 128
    """B: completed trajectories (from B distinct prompts) per actor step (paper: 128)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by run.seed)."""
    trajectories_path: str = ""
    """Recorded trajectories (Parquet or JSONL as written by rollout/trajectory_io.py) for
    `rollout.source=recorded` and `sao sft`. In a recipe, a relative path is relative to the
    recipe file."""


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation during training (`rollout.source=engine`): held-out prompts rolled out on the run's
    engines between batches while the training rollouts go on; logged as `eval/success`,
    `eval/reward` (pipeline/evaluation.py)."""

    every_n_steps: int = 0
    """Evaluate after every N train steps (and before the first and after the last); 0: off. An
    evaluation still running when the next is due makes that one skip."""
    num_prompts: int = 64
    """Held-out prompts per evaluation: the first N of `eval.prompts_path`, the same every time."""
    prompts_path: str = ""
    """Held-out prompt dataset (the schema of `data.train_path`); required when evaluating. In a
    recipe, a relative path is relative to the recipe file."""


@dataclass(kw_only=True)
class LoggingConfig:
    wandb_project: str = "megatron-sao"
    """wandb project."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode: offline by default (sync later with `wandb sync`)."""
    log_every: int = 1
    """Log metrics every N actor steps."""
    param_table: bool = True
    """Print the trainable / frozen parameter table at start."""
    progress_interval_s: float = 30.0
    """Live progress of `sao train` / `sao demo` stages (step / total, reward, success, EV,
    staleness, tokens/s, ETA): redrawn in place on a terminal at every step; in a log file or pipe
    a plain line every this many seconds. 0: off."""


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""
    """Checkpoint directory ('' = <run dir>/checkpoints)."""
    save_every: int = 50
    """Save every N actor steps (0: only at the end)."""
    keep_last: int = 3
    """Keep this many most recent checkpoints."""
    async_save: bool = True
    """GPU: write checkpoint shards in the background while training continues (the checkpoint
    becomes complete, and `latest`, once written). CPU runs always save synchronously."""
    resume: bool | str = "auto"
    """'auto': resume from the latest complete checkpoint of the run if there is one; true: the
    same, but a missing checkpoint is an error; false or 'none': start fresh."""


@dataclass(kw_only=True)
class LauncherConfig:
    kind: Literal["local", "slurm"] = "local"
    """Where processes run: this machine, or a Slurm allocation."""
    nnodes: int = 1
    """Nodes."""
    nproc_per_node: int = 1
    """Trainer processes per node (one per GPU)."""
    partition: str = ""
    """Slurm partition."""
    account: str = ""
    """Slurm account."""
    time_limit: str = "24:00:00"
    """Slurm time limit."""
    container_image: str = ""
    """Container image for Slurm jobs (pyxis/enroot), see launchers/container/."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More #SBATCH lines, verbatim."""
    gpu_type: str = ""
    """GPU the recipe targets (e.g. "h200-141g"; see `sao plan --help`): `sao plan`'s default."""
    engine_placement: Literal["auto", "colocated", "disaggregated"] = "auto"
    """Where rollout engines run: on the trainer GPUs (time-shared), on GPUs of their own, or
    decided from parallelism.world_size vs the allocation (auto)."""
    ray: bool = False
    """Place the trainer ranks and the rollout engines as Ray actors in one placement group sized
    from the config (pipeline/placement.py), on a local Ray instance or the cluster at
    `ray_address`; false: local processes (`launcher.kind=local`) or srun tasks (`slurm`)."""
    ray_address: str = ""
    """With `launcher.ray`: '' starts a local Ray instance (one machine); 'auto' or HOST:PORT joins
    a running cluster (the one a `sao launch slurm` job starts)."""
    requeue: bool = False
    """Slurm: requeue the job after a preemption / time-limit checkpoint (resumes automatically)."""
    network_interface: str = ""
    """Network interface whose IP the nodes advertise to Ray / torch.distributed ('' = resolve the
    hostname); the chosen address is logged."""
    port_range: str = "20000-29999"
    """Ports a job takes its block (Ray, torch.distributed) from, chosen per job id so that jobs
    sharing a node do not collide."""
    join_timeout_s: int = 300
    """Seconds to wait for every node to join the Ray cluster before failing the job."""
    container_mounts: list[str] = field(default_factory=list)
    """Extra container mounts (SRC:DST) for Slurm jobs with a container image."""


@dataclass(kw_only=True)
class ValuePretrainConfig:
    """`sao value-pretrain generate | train`: a rollout corpus from the SFT policy, then the critic
    alone trained on it (docs/value-pretraining.md). Batch size, steps, targets and the critic's
    optimizer come from `data.batch_size`, `run.total_steps`, `algorithm` and `critic`."""

    corpus_dir: str = ""
    """Corpus directory (sharded Parquet + manifest.json). '' = `<run.output_dir>/<run.name>/corpus`."""
    samples_per_prompt: int = 4
    """Trajectories generated per prompt of `data.train_path` (not `algorithm.group_size`)."""
    num_prompts: int | None = None
    """Use only the first N prompts of `data.train_path` (None: all)."""
    prompts_per_shard: int = 256
    """Prompts whose trajectories go into one Parquet shard (the unit of resume when generating)."""
    row_group_size: int = 64
    """Trajectories per Parquet row group: the unit each data-parallel rank reads and shuffles."""
    heldout_fraction: float = 0.05
    """Share of prompts (chosen by a seeded hash of the prompt id) written to held-out shards."""
    verify_hashes: bool = True
    """Check every shard's SHA-256 against the manifest before training (each rank a share)."""
    on_bad_shard: Literal["skip", "stop"] = "stop"
    """A shard that is missing, unreadable or fails its hash: report it and skip it, or stop."""
    eval_every: int = 50
    """Evaluate on the held-out split every N steps (and after the last step); 0: only at the end."""
    eval_max_trajectories: int = 256
    """Held-out trajectories evaluated (the first N of the held-out split, always the same ones)."""
    calibration_bins: int = 10
    """Bins of predicted value in the calibration table (equal width over the held-out return range)."""


@dataclass(kw_only=True)
class SaoConfig:
    """A whole megatron-sao run."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    value_pretrain: ValuePretrainConfig = field(default_factory=ValuePretrainConfig)
