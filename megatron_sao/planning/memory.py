"""Per-GPU memory of a recipe: trainer states, activations, engines; a fits / does-not-fit verdict.

The model (all terms in GiB per GPU, for the worst pipeline stage):
- weights: bf16 (fp32 on CPU recipes), dense parameters sharded over TP (embedding on the first
  stage, LM head on the last) except norms, the router and the DSA indexer (whole on every TP
  rank), routed experts over ETP x EP; PP splits layers evenly; `rank_parameters` gives the
  counts, which `sao train --dry-run` checks against the model the trainer builds;
- gradients: fp32 main-grad buffers (`grad_reduce_in_fp32`), trainable parameters only, not
  sharded over data parallel;
- optimizer: Adam m and v plus fp32 master weights (12 B per trainable parameter; 8 B when the
  model is fp32), divided over the data-parallel group (x CP for dense parameters, expert-DP for
  experts) by the distributed optimizer;
- activations: the estimate of `ModelCensus.activation_elems_per_token` per layer and token,
  divided by TP (sequence parallel) and CP, for `min(PP - stage, micro-batches)` micro-batches in
  flight (1F1B), plus one layer's working set for the backward, for the largest micro-batch (the
  token budget, or one `rollout.max_total_tokens` trajectory alone when longer). Attention is
  flash-style (no [s, s] scores or mask). `full` recompute keeps only each layer's input;
  `selective` is counted as `none` (it recomputes core attention, which flash attention does not
  store anyway). The actor's last stage adds the logits of one `actor.logits_chunk_tokens` chunk
  (model dtype + 16 B of fp32 copies per token x vocab / TP; all local tokens when unset). Actor and
  critic train one after the other: the larger of the two counts;
- engines: SGLang reserves `mem_fraction_static` of the GPU for weights (sharded over the
  engine's TP) and KV cache; the KV pool must hold at least one `rollout.max_total_tokens`
  trajectory. Colocated engines add that reservation to the trainer GPU;
- runtime_overhead: 3 GiB per GPU for the CUDA context, NCCL buffers and allocator slack.
Not modelled: Megatron's vocabulary padding, optimizer CPU offload, fragmentation beyond the
overhead term, MTP layers in training (the trainer does not train them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sao.config.placement import GpuLayout, gpu_layout
from megatron_sao.config.schema import RoleConfig, SaoConfig
from megatron_sao.config.validate import expert_tensor_size, trainer_world_size
from megatron_sao.planning.gpus import GIB, GpuSpec
from megatron_sao.planning.params import GROUPS, ModelCensus

RUNTIME_OVERHEAD_GIB = 3.0
GRAD_BYTES = 4
LOGIT_FP32_BYTES = 16
"""Per logit beyond the model's own: the fp32 copy divided by the temperature (which the cross
entropy turns into its softmax in place) and the entropy's three fp32 temporaries."""


@dataclass(slots=True)
class MemoryPlan:
    gpu: GpuSpec
    layout: GpuLayout
    trainer: dict[str, float]
    """Trainer GPU terms in GiB (engine terms too when colocated), with `total`."""
    engine: dict[str, float] = field(default_factory=dict)
    """Engine GPU terms in GiB when disaggregated, with `total`; empty otherwise."""
    worst_stage: int = 0
    engine_kv_capacity_tokens: int = 0
    """Tokens one engine's KV pool holds (0 without GPU engines)."""
    problems: list[str] = field(default_factory=list)
    """Why it does not fit (empty when it fits)."""
    culprit: str = ""
    """The term named in the verdict: the largest term of the GPU that does not fit (engine
    weights when they crowd out the KV cache), or of the trainer GPU when everything fits."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def largest_term(self) -> str:
        if self.culprit:
            return self.culprit
        return _largest(self.trainer)


def _largest(terms: dict[str, float]) -> str:
    return max((k for k in terms if k != "total"), key=terms.get)


def _trainable_groups(role: RoleConfig) -> set[str]:
    """Groups that train; `re:` specs cannot be resolved before Megatron names exist, so a
    trainable regex counts every group as trainable and a frozen regex freezes nothing
    (the estimate errs towards more memory)."""
    trainable = set(GROUPS) if any(s == "all" or s.startswith("re:") for s in role.trainable) else set(role.trainable)
    return trainable - {s for s in role.frozen if not s.startswith("re:")}


def _stage_layers(num_layers: int, pp: int, stage: int) -> range:
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per if stage < pp - 1 else num_layers)


@dataclass(frozen=True, slots=True)
class RankParameters:
    """What one trainer GPU holds of one role: the counts behind the weights, gradients and
    optimizer terms (`sao train --dry-run` compares them with what the trainer builds)."""

    params: float
    trainable: float
    optimizer_elems: float
    """Parameters whose optimizer state (master copy, Adam m and v) this GPU holds: the trainable
    ones divided over data parallel by the distributed optimizer."""


def rank_parameters(config: SaoConfig, census: ModelCensus, stage: int, critic: bool) -> RankParameters:
    """The actor's (or critic's) parameters on one GPU of pipeline `stage`."""
    p = config.parallelism
    role = config.critic if critic else config.actor
    world = trainer_world_size(config)
    etp = expert_tensor_size(config)
    dp_dense = world // (p.tensor * p.pipeline)  # distributed optimizer shards over DP x CP
    dp_expert = world // (etp * p.expert * p.pipeline)
    trainable = _trainable_groups(role)
    counts: dict[str, int] = {}
    replicated_attention = 0
    for index in _stage_layers(census.num_layers, p.pipeline, stage):
        for group, n in census.layers[index].items():
            counts[group] = counts.get(group, 0) + n
        replicated_attention += census.tp_replicated[index] if census.tp_replicated else 0
    if stage == 0:
        counts["embedding"] = counts.get("embedding", 0) + census.outside.get("embedding", 0)
    if stage == p.pipeline - 1:
        counts["norms"] = counts.get("norms", 0) + census.outside.get("norms", 0)
        head = census.value_head if critic else census.outside.get("head", 0)
        counts["head"] = counts.get("head", 0) + head
    params = trained = optimizer = 0.0
    for group, n in counts.items():
        expert = group == "experts"
        # Norms, the router (megatron-core 0.19.2 TopKRouter: a [experts, hidden] weight on every
        # TP rank) and the critic's value head are replicated over TP.
        replicated = group in ("norms", "router") or (critic and group == "head")
        shard = etp * p.expert if expert else (1 if replicated else p.tensor)
        local = n / shard
        if group == "attention":
            local += replicated_attention * (1 - 1 / shard)
        params += local
        if group in trainable:
            trained += local
            dp = dp_expert if expert else dp_dense
            optimizer += local / (dp if role.optim.use_distributed_optimizer else 1)
    return RankParameters(params, trained, optimizer)


def _role_states(config: SaoConfig, census: ModelCensus, stage: int, critic: bool) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of one role on one GPU of `stage`."""
    w_bytes = 4 if config.model.dtype == "float32" else 2
    optim_bytes = 8 if config.model.dtype == "float32" else 12
    counts = rank_parameters(config, census, stage, critic)
    return counts.params * w_bytes, counts.trainable * GRAD_BYTES, counts.optimizer_elems * optim_bytes


def micro_batch_tokens(config: SaoConfig, role: RoleConfig) -> int:
    """Padded tokens of the largest micro-batch: the token budget, or a longest trajectory alone
    when it exceeds it (training/batches.py gives such a trajectory a micro-batch of its own)."""
    longest = config.rollout.max_total_tokens
    if role.max_tokens_per_micro_batch is None:
        return role.micro_batch_size * longest
    return max(role.max_tokens_per_micro_batch, longest)


def _activations(config: SaoConfig, census: ModelCensus, role: RoleConfig, stage: int, critic: bool) -> float:
    p = config.parallelism
    act_bytes = 4 if config.model.dtype == "float32" else 2
    tokens = micro_batch_tokens(config, role)
    local_tokens = tokens / (p.context * p.tensor)
    dp = trainer_world_size(config) // (p.tensor * p.pipeline * p.context)
    trajectories = config.data.batch_size * config.algorithm.group_size
    micro_batches = max(1, -(-trajectories // (dp * role.micro_batch_size)))
    in_flight = min(p.pipeline - stage, micro_batches)
    layers = _stage_layers(census.num_layers, p.pipeline, stage)
    per_layer = [census.activation_elems_per_token(i) for i in layers]
    stored_per_layer = [census.hidden_size] * len(per_layer) if config.model.recompute_granularity == "full" \
        else per_layer
    # Everything the in-flight micro-batches keep, plus the backward's working set of one layer
    # (its activation gradients, or under full recompute its recomputed activations).
    elems = sum(stored_per_layer) * in_flight + max(per_layer)
    if stage == 0:
        elems += census.hidden_size  # the embedding output
    if stage == p.pipeline - 1:
        elems += 2 * census.hidden_size  # the final norm's input and output
    total = elems * local_tokens * act_bytes
    if not critic and stage == p.pipeline - 1:
        # Logits of `actor.logits_chunk_tokens` tokens at a time (all local tokens when unset),
        # never kept across chunks (training/logits.py).
        chunk = config.actor.logits_chunk_tokens
        logit_tokens = tokens / p.context if chunk is None else min(chunk, tokens / p.context)
        total += logit_tokens * census.vocab_size / p.tensor * (act_bytes + LOGIT_FP32_BYTES)
    return total


def activation_bytes(config: SaoConfig, census: ModelCensus, stage: int) -> float:
    """The activation term of one GPU of `stage`: actor and critic train one after the other, so
    the larger of the two."""
    activations = _activations(config, census, config.actor, stage, critic=False)
    if uses_critic(config):
        activations = max(activations, _activations(config, census, config.critic, stage, critic=True))
    return activations


def _engine_terms(config: SaoConfig, census: ModelCensus, gpu: GpuSpec, layout: GpuLayout,
                  problems: list[str]) -> tuple[dict[str, float], int]:
    """Engine GPU terms and one engine's KV capacity in tokens; a problem when the weights leave
    no KV pool or the pool cannot hold one whole trajectory (both blamed on engine_weights)."""
    sglang, rollout = config.rollout.sglang, config.rollout
    tp = layout.gpus_per_engine
    weights = census.params_total * 2 / tp
    reserved = sglang.mem_fraction_static * gpu.memory_bytes
    if census.kv_heads is None:  # MLA latent cache: every TP rank holds it; DP attention splits requests
        per_token = census.num_layers * census.kv_cache_elems_per_layer * 2
        per_token_per_engine = per_token / max(1, sglang.data)
    else:
        local_heads = -(-census.kv_heads // tp)
        per_token = census.num_layers * census.kv_cache_elems_per_layer * local_heads / census.kv_heads * 2
        per_token_per_engine = per_token
    kv_pool = reserved - weights
    capacity = int(kv_pool / per_token_per_engine) if kv_pool > 0 else 0
    if kv_pool <= 0:
        problems.append(f"engine weights {weights / GIB:.1f} GiB per GPU exceed rollout.sglang.mem_fraction_static "
                        f"x GPU = {reserved / GIB:.1f} GiB (raise rollout.sglang.tensor)")
    elif capacity < rollout.max_total_tokens:
        problems.append(f"engine KV cache holds {capacity} tokens, less than one rollout.max_total_tokens = "
                        f"{rollout.max_total_tokens} trajectory (raise rollout.sglang.tensor or mem_fraction_static)")
    terms = {"engine_weights": weights / GIB, "engine_kv_cache": max(kv_pool, 0) / GIB}
    return terms, capacity


def uses_critic(config: SaoConfig) -> bool:
    """GRPO and running-mean baselines need no value function, so no critic is built."""
    return config.algorithm.advantage in ("gae", "step_level")


def plan_memory(config: SaoConfig, census: ModelCensus, gpu: GpuSpec) -> MemoryPlan:
    """Per-GPU memory of `config` on `gpu`; ConfigError when the GPU split is impossible."""
    layout = gpu_layout(config)
    best: tuple[float, int, dict[str, float]] | None = None
    for stage in range(config.parallelism.pipeline):
        actor = _role_states(config, census, stage, critic=False)
        critic = (_role_states(config, census, stage, critic=True) if uses_critic(config)
                  else (0.0, 0.0, 0.0))
        activations = activation_bytes(config, census, stage)
        terms = {
            "actor_weights": actor[0], "actor_grads": actor[1], "actor_optimizer": actor[2],
            "critic_weights": critic[0], "critic_grads": critic[1], "critic_optimizer": critic[2],
            "activations": activations,
        }
        terms = {k: v / GIB for k, v in terms.items()}
        terms["runtime_overhead"] = RUNTIME_OVERHEAD_GIB
        total = sum(terms.values())
        if best is None or total > best[0]:
            best = (total, stage, terms)
    assert best is not None
    _, stage, trainer = best
    problems: list[str] = []
    engine: dict[str, float] = {}
    capacity = 0
    if layout.engine_gpus:
        engine_terms, capacity = _engine_terms(config, census, gpu, layout, problems)
        if layout.placement == "colocated":
            trainer.update(engine_terms)
        else:
            engine = {**engine_terms, "runtime_overhead": RUNTIME_OVERHEAD_GIB}
            engine["total"] = sum(engine.values())
    trainer["total"] = sum(trainer.values())
    plan = MemoryPlan(gpu, layout, trainer, engine, stage, capacity, problems)
    if trainer["total"] > gpu.memory_gib:
        plan.culprit = _largest(trainer)
        problems.insert(0, f"trainer GPU needs {trainer['total']:.1f} GiB > {gpu.memory_gib:.1f} GiB "
                           f"(largest term: {plan.culprit})")
    elif engine and engine["total"] > gpu.memory_gib:
        plan.culprit = _largest(engine)
        problems.insert(0, f"engine GPU needs {engine['total']:.1f} GiB > {gpu.memory_gib:.1f} GiB "
                           f"(largest term: {plan.culprit})")
    elif problems:
        plan.culprit = "engine_weights"
    return plan
