"""Recipe schema: every key defined once, validated before any work starts.

A recipe is a YAML file. Papermill parameters, ``canntrain ... --set a.b=c`` and the
YAML itself all use the same dotted keys. ``load_recipe`` returns a validated
:class:`Recipe`; any problem is a :class:`RecipeError` naming the file and the key
(and, where the YAML says, the line).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from canntrain_core.errors import RecipeError
from canntrain_core.recipe_file import read_recipe_file
from canntrain_core.families import FAMILIES, PRESET_FAMILY
from canntrain_core.sizing.devices import DEVICES
from canntrain_core.sizing.layout import Layout, layout_problems
from canntrain_core.sizing.presets import PRESETS


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ExperimentConfig(_Section):
    """The run's name, where it goes and its seed."""

    # The run's name: its directory under output_dir is <name>-<timestamp> when --run-dir is not given.
    name: str = "run"
    # Where runs without --run-dir go ($CANNTRAIN_RUNS wins when set).
    output_dir: str = "runs"
    # Seeds the model's initialisation, the data order and sampling; the same seed, layout and machine repeat a run
    # exactly.
    seed: int = Field(1234, ge=0)


class ModelConfig(_Section):
    """The model: a preset shape or a Hugging Face directory, its precision, kernels and recompute."""

    # The model family (canntrain_core/families/: llama, qwen2, qwen3, mistral, gpt2, mixtral, qwen2_moe, qwen3_moe).
    # Unset: the preset's, or init_from's config.json model_type; set, it must agree with them.
    type: str | None = None
    # A shape by name (canntrain_core/sizing/presets.py: tiny, llama2-7b, qwen2.5-72b, ...). A recipe names
    # this or init_from: there is no default model (one would train a shape nobody asked for without a word).
    preset: str | None = None
    # A Hugging Face model directory (config.json + safetensors, tokenizer.json if any) to start
    # from: the architecture and weights come from there, and preset / overrides must agree with it.
    init_from: str | None = None
    # Keys of the transformers config to change, e.g. {num_hidden_layers: 2}.
    overrides: dict[str, Any] = Field(default_factory=dict)
    # fp32 by default: the tiny CPU recipes (bf16 on a CPU is slow and lossy); every 910B recipe sets bf16, the
    # cann-recipes-train articles' default.
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"
    # Which fused-kernel backend the model uses (see canntrain_kernels/): auto picks the fastest checked one.
    kernels: Literal["auto", "eager", "compile", "npu", "cuda", "cpu"] = "eager"
    # Per-op backend choices that win over `kernels`, e.g. {cross_entropy: eager}.
    kernel_overrides: dict[
        Literal["rms_norm", "apply_rotary", "swiglu", "attention", "cross_entropy", "expert_mlp", "attention_block"],
        Literal["auto", "eager", "compile", "npu", "cuda", "cpu"],
    ] = Field(default_factory=dict)
    # none | selective (every other decoder layer recomputed) | full (every layer)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = False  # torch.compile each decoder layer
    # A mixture of experts: each expert takes at most this x an even share of a micro-batch's (token, k)
    # assignments, the lowest router weights over it dropped (counted as dropped_tokens). None: none dropped.
    expert_capacity_factor: float | None = Field(None, gt=0)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; known: {', '.join(sorted(PRESETS))}")
        return v

    @field_validator("type")
    @classmethod
    def _known_family(cls, v: str | None) -> str | None:
        if v is not None and v not in FAMILIES:
            raise ValueError(f"unknown model family {v!r}; known: {', '.join(FAMILIES)}")
        return v

    @model_validator(mode="after")
    def _type_is_the_presets(self) -> "ModelConfig":
        family = PRESET_FAMILY[self.preset].name if self.preset else None  # (init_from's: from config.json)
        if self.type is not None and family and not self.init_from and self.type != family:
            raise ValueError(f"model.type={self.type} but model.preset={self.preset} is a {family} model")
        if self.expert_capacity_factor is not None and self.family and not FAMILIES[self.family].router_class:
            raise ValueError(
                f"model.expert_capacity_factor is for a mixture of experts; {self.family} models have no experts"
            )
        return self

    @property
    def family(self) -> str | None:
        """The family of the preset, or model.type; None for an init_from model that says neither (its
        config.json's model_type says it)."""
        return self.type or (PRESET_FAMILY[self.preset].name if self.preset else None)


class TokenizerConfig(_Section):
    """data.tokenizer: a pretrained tokenizer to use, or the settings of one trained here."""

    # A pretrained tokenizer directory (tokenizer.json, or a SentencePiece tokenizer.model): pretraining from
    # scratch with Llama's, Qwen's or Mistral's own vocabulary. Unset: a prepared dataset's tokenizer, else
    # model.init_from's, else a byte-level BPE (`type`) trained here on `sample_bytes` of the corpus.
    path: str | None = None
    # The kind of tokenizer trained here when none is given: a byte-level BPE.
    type: Literal["bpe"] = "bpe"
    # The model's embedding rows. Unset: the pretrained or prepared tokenizer's own size (4096 for one trained
    # here); set: at least the tokenizer's size (extra rows pad, as Megatron's make-vocab-size-divisible-by).
    vocab_size: int = Field(4096, ge=260, le=2**20)
    # Text a tokenizer trained here learns from: spread over the corpus, never all of a large one.
    sample_bytes: int = Field(100_000_000, gt=0)


class SourceWeight(_Section):
    """One source of a mixture (``data.sources``): a prepared dataset (``canntrain prepare``), a Megatron
    ``.bin``/``.idx`` prefix, or raw records / text as ``data.source`` takes them."""

    path: str
    weight: float = Field(1.0, gt=0)
    # how its metrics are named (tokens/<name>); unset: the path's last part
    name: str | None = None


class TemplateConfig(_Section):
    """How a conversation becomes text when the tokenizer brings no chat template of its own (or
    ``data.chat_template: recipe`` says so). ``{content}`` is the turn's text; ``{eos}`` in the assistant
    string the tokenizer's end-of-text token (it ends an answer, so generation stops there). A checkpoint
    and its export carry it as an equivalent Jinja chat template (``chat_template.jinja``)."""

    # A system turn's text ({content}: the turn).
    system: str = "{content}\n\n"
    # A user turn's text ({content}: the turn): the prompt the model answers.
    user: str = "### Instruction:\n{content}\n\n### Response:\n"
    # An assistant turn's text; {eos} ends the answer, so generation stops there.
    assistant: str = "{content}{eos}"

    @model_validator(mode="after")
    def _placeholders(self) -> "TemplateConfig":
        for role in ("system", "user", "assistant"):
            if getattr(self, role).count("{content}") != 1:
                raise ValueError(f"data.template.{role} must contain {{content}} exactly once")
        return self


# data keys that only instruction data reads (train_mode sft); a pretraining recipe may not set them
SFT_DATA_KEYS = ("format", "train_on", "truncation", "packing", "template", "chat_template")


class DataConfig(_Section):
    """What to train on, how it is tokenized, split, batched and (for instruction data) formatted."""

    # What to train on (one of source / sources). Pretraining: a prepared dataset (`canntrain prepare`), a
    # Megatron .bin/.idx prefix, or raw text prepared in process on first use: "stdlib" (this interpreter's
    # standard-library .py files), a directory, .jsonl / .jsonl.gz / .jsonl.zst / .parquet files, a datasets
    # directory or a glob (records hold the text under `text_field`). Other stages: instruction or preference
    # records in those record formats (alpaca, messages or ShareGPT; see canntrain_core/finetune/records.py).
    source: str | None = None
    # A weighted mixture instead: [{path, weight, name}, ...]; samples are drawn by weight (token-weighted for
    # pretraining, whose samples are all seq_length tokens), deterministically, each source on its own epochs.
    sources: list[SourceWeight] | None = Field(None, min_length=1)
    # A source drawn more than this many times over (epochs) in optim.max_steps is refused before training.
    max_source_epochs: float | None = Field(None, gt=0)
    # The field of a JSONL / Parquet / datasets record that holds a document's text (pretraining).
    text_field: str = "text"
    # Deterministic subset of a raw corpus, so tiny recipes tokenize in seconds (a prepared one is used whole).
    max_bytes: int | None = Field(None, gt=0)
    # At most this many files of a raw directory or glob (a deterministic subset, as max_bytes).
    max_files: int | None = Field(None, gt=0)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    # Tokens per training row (pretraining rows are windows of the token stream; SFT rows are padded or packed).
    seq_length: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0, description="micro-batch per device")
    # DataLoader worker processes per rank (0: batches are built in the training process).
    num_workers: int = Field(0, ge=0)
    # Keep the DataLoader's workers alive between epochs (needs num_workers > 0).
    persistent_workers: bool = False
    # Share held out for validation: whole documents (pretraining, by token share) or records (other stages).
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    # Where raw sources are prepared in process and tokenizers trained here are cached (default: $CANNTRAIN_CACHE,
    # else ~/.cache/canntrain).
    cache_dir: str | None = None
    # A JSONL line that is not a usable record, or a file in a text directory that is not UTF-8
    # text: "error" stops with its file and line, "skip" leaves it out and counts it (info["bad_records"]).
    on_bad_record: Literal["skip", "error"] = "error"
    # instruction data (train_mode sft):
    format: Literal["auto", "alpaca", "messages", "sharegpt"] = "auto"
    # Which tokens the loss trains on: every assistant answer, only the final one, or all tokens.
    train_on: Literal["assistant", "last", "all"] = "assistant"
    # A sample longer than seq_length: drop prompt tokens from the left (never the answer), or drop it.
    truncation: Literal["truncate_prompt", "drop"] = "truncate_prompt"
    # Several samples per row, attention confined to each (block-diagonal causal mask).
    packing: bool = False
    template: TemplateConfig = Field(default_factory=TemplateConfig)
    # Which template turns conversations into text (every stage that reads them: sft, reward, dpo, grpo,
    # ppo): "tokenizer" the chat template of model.init_from's tokenizer (chat_template.jinja,
    # additional_chat_templates/ or tokenizer_config.json; an error when it has none), "recipe" data.template,
    # "auto" the tokenizer's when it has one, else data.template. Checkpoints and exports carry the one used.
    chat_template: Literal["auto", "tokenizer", "recipe"] = "auto"

    @model_validator(mode="after")
    def _workers(self) -> "DataConfig":
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("persistent_workers needs num_workers > 0")
        if self.source is not None and self.sources is not None:
            raise ValueError("give data.source or data.sources, not both (set data.source=null to use sources)")
        return self

    @property
    def mixture(self) -> list[SourceWeight]:
        """The sources with their weights: ``data.sources``, or ``data.source`` alone with weight 1."""
        if self.sources is not None:
            return list(self.sources)
        if self.source is None:
            raise ValueError("data.source: not set; name the data to train on (data.source or data.sources)")
        return [SourceWeight(path=self.source)]


class OptimConfig(_Section):
    """AdamW, the learning-rate schedule, accumulation, clipping and the run's length."""

    # The optimizer: AdamW (decoupled weight decay; norms and biases are not decayed).
    name: Literal["adamw"] = "adamw"
    # Peak learning rate, reached after warmup.
    lr: float = Field(1e-3, gt=0)
    # AdamW's decoupled weight decay on the weight matrices.
    weight_decay: float = Field(0.1, ge=0)
    # AdamW's (beta1, beta2).
    betas: tuple[float, float] = (0.9, 0.95)
    # AdamW's epsilon.
    eps: float = Field(1e-8, gt=0)
    # The decay after warmup: cosine or linear to min_lr_ratio x lr, or constant.
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    # Warmup as a share of max_steps (or warmup_steps; not both). Neither: no warmup.
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    # Linear warmup steps from 0 to lr (or warmup_ratio; not both).
    warmup_steps: int | None = Field(None, ge=0)
    # The schedule ends at this x lr.
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # Micro-batches per optimizer step: global batch = batch_size x data-parallel ranks x this.
    grad_accum_steps: int = Field(1, gt=0)
    # Optimizer steps of the run (computed from epochs when that is set).
    max_steps: int = Field(100, gt=0)
    # Passes over the training data; when set, the trainer computes max_steps from it (and says so).
    epochs: float | None = Field(None, gt=0)
    # Clip the global gradient norm to this (None: no clipping); the norm is logged before clipping.
    grad_clip: float | None = Field(1.0, gt=0)
    # Keep AdamW states (and fp32 master weights) in host memory: the cann-recipes-train articles' "swap optimizer".
    offload_optimizer: bool = False
    # A step whose gradient norm is NaN or inf (a NaN or inf loss or gradient): stop, naming the last complete
    # checkpoint to resume from, or skip it (no update; counted as skipped_steps). fp16's loss scaler skips such
    # steps itself, lowering its scale.
    nonfinite: Literal["stop", "skip"] = "stop"

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _one_warmup(self) -> "OptimConfig":
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError("give warmup_ratio or warmup_steps, not both")
        return self

    @property
    def warmup(self) -> int:
        """Warmup length in optimizer steps."""
        if self.warmup_steps is not None:
            return min(self.warmup_steps, self.max_steps)
        return int(round((self.warmup_ratio or 0.0) * self.max_steps))


class DistributedConfig(_Section):
    """The parallel layout (tp x pp x dp x cp, ep over dp x cp, ZeRO stage) and the job's devices."""

    # Processes of the job: tensor x pipeline x data x context parallel sizes (PPO's separated placement adds
    # rlhf.scorer_ranks).
    world_size: int = Field(1, gt=0)
    # Ranks each layer's matrices are split over (Megatron's TP; within a node unless allow_cross_node_tp).
    tensor_parallel_size: int = Field(1, gt=0)
    # Pipeline stages the layers are split into.
    pipeline_parallel_size: int = Field(1, gt=0)
    # Replicas (or ZeRO/FSDP shards) that each train on their own rows.
    data_parallel_size: int = Field(1, gt=0)
    # Ranks each row's tokens are split over (ring attention; long sequences).
    context_parallel_size: int = Field(1, gt=0)
    # Experts are spread over data/context-parallel ranks (as in Megatron), so ep is not a factor
    # of world_size; it must divide data_parallel_size * context_parallel_size.
    expert_parallel_size: int = Field(1, gt=0)
    # ZeRO stage 0-3 (true means 3, i.e. FSDP full sharding; false means 0).
    zero_optimization: int = Field(0, ge=0, le=3)
    # With tensor parallel: keep activations split along the sequence between TP regions
    # (Megatron's SP; norms and residuals on 1/tp of the tokens).
    sequence_parallel: bool = False
    # With tensor parallel: the embedding and the output head split over the vocabulary, and the loss computed
    # on each rank's slice of the logits (never the whole [tokens, vocab] on one rank).
    vocab_parallel: bool = True
    # 1F1B (less activation memory) or GPipe (all forwards, then all backwards).
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # Seconds a collective may wait before the job fails (instead of hanging).
    timeout_seconds: int = Field(600, gt=0)
    # Tensor parallelism is all-reduce heavy: keep it inside a node unless told otherwise.
    allow_cross_node_tp: bool = False
    # Micro-batches per pipeline step; None means grad_accum_steps (each accumulation step is one).
    num_microbatches: int | None = Field(None, gt=0)
    # The device the recipe is sized for (a preset of canntrain_core/sizing/devices.py, e.g. 910b):
    # `canntrain estimate` checks against its memory, and the shipped recipes are tested to fit it.
    target_device: str | None = None
    # Rehearse on a smaller device: each rank may hold at most this many GiB beyond what it held before its model
    # was built (the device allocator's per-process fraction; on a CPU the process's data size limit), so a run
    # that needs more fails with the out-of-memory diagnosis, as it would there.
    memory_budget_gb: float | None = Field(None, gt=0)

    @field_validator("target_device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is not None and v.lower() not in DEVICES:
            raise ValueError(f"unknown device {v!r}; presets: {', '.join(DEVICES)}")
        return v

    @field_validator("zero_optimization", mode="before")
    @classmethod
    def _zero_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return 3 if v else 0
        return v

    @model_validator(mode="after")
    def _sizes(self) -> "DistributedConfig":
        sizes = Layout(
            tp=self.tensor_parallel_size,
            pp=self.pipeline_parallel_size,
            dp=self.data_parallel_size,
            cp=self.context_parallel_size,
            ep=self.expert_parallel_size,
        )
        problem = sizes.size_problem(self.world_size)
        if problem:
            raise ValueError(problem)
        return self


class LoraSettings(_Section):
    """LoRA adapters through peft: only the adapters train; checkpoints hold only them."""

    # Train LoRA adapters (train_mode sft) instead of every weight.
    enabled: bool = False
    # The adapters' rank r.
    rank: int = Field(16, gt=0)
    # The adapters' scale is alpha / rank (peft's lora_alpha).
    alpha: float = Field(32.0, gt=0)
    # Dropout on the adapters' input (peft's lora_dropout).
    dropout: float = Field(0.05, ge=0, lt=1)
    # The projections that get adapters (peft's target_modules).
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # QLoRA: hold the frozen base's block linear layers in 4-bit NF4 (bitsandbytes, as transformers'
    # BitsAndBytesConfig(load_in_4bit=True) with double quantization), computed in model.precision (bf16 or fp16).
    # One device, CUDA or CPU: bitsandbytes has no Ascend backend.
    load_in_4bit: bool = False


def qlora_problem(recipe: "Recipe") -> str | None:
    """Why ``lora.load_in_4bit`` cannot run as ``recipe`` says, or None."""
    device = DEVICES.get(recipe.distributed.target_device or "")
    if not recipe.lora.enabled:
        return "a 4-bit base is LoRA's (set lora.enabled)"
    if recipe.model.precision == "fp32":
        return "the 4-bit weights compute in model.precision bf16 or fp16, not fp32"
    if recipe.distributed.world_size != 1:
        return "one device only (FSDP2 and tensor parallel do not shard bitsandbytes' packed weights here)"
    if device is not None and device.runtime == "npu":
        return f"bitsandbytes has no Ascend backend (distributed.target_device {recipe.distributed.target_device})"
    return None


class RolloutConfig(_Section):
    """rlhf.rollout (grpo, ppo): which engine samples the responses. local: the trainer's own KV-cached loop
    (models/rollout.py); vllm: a vLLM process beside the trainer (engines/), its weights replaced after each update."""

    # local: this process samples (the tiny recipes' default); vllm: a vLLM engine in its own process and environment.
    backend: Literal["local", "vllm"] = "local"
    # vllm: the interpreter of the vLLM environment (make vllm-env makes .venv-vllm/bin/python); None:
    # $CANNTRAIN_VLLM_PYTHON, else the repository's .venv-vllm when there is one.
    python: str | None = None
    # vllm: a rollout server already running (started by hand from engines/vllm_server.py), instead of starting one.
    url: str | None = None
    # vllm: how many updates older than the trained weights the sampling weights may be. 0: each batch is sampled
    # after the previous update (on-policy); 1: the next batch is sampled while this one trains (verl's and TRL's
    # one-step-off async), the ratio taken against the sampling weights' log-probabilities.
    staleness: int = Field(0, ge=0)
    # vllm: tensor-parallel ranks of the engine.
    tensor_parallel_size: int = Field(1, gt=0)
    # vllm on an accelerator: the share of each engine device's memory vLLM may take (weights + KV cache); keep it
    # low enough for training when the engine shares the trainer's devices.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # vllm: GiB of KV cache (on a CPU VLLM_CPU_KVCACHE_SPACE); None: vLLM's default, most of the free memory.
    kv_cache_gib: float | None = Field(None, gt=0)
    # vllm: the engine's weights dtype; auto: model.precision's.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # vllm: the longest prompt + response the engine admits; None: the model's max_position_embeddings.
    max_model_len: int | None = Field(None, gt=0)
    # vllm: the devices a started engine sees (CUDA_VISIBLE_DEVICES or ASCEND_RT_VISIBLE_DEVICES), e.g. "4,5,6,7";
    # None: the same as the trainer's.
    devices: str | None = None
    # vllm: no graph capture or compilation (faster start, slower decoding; what a CPU test wants).
    enforce_eager: bool = False
    # vllm: seconds a started engine may take to load before the run stops (also the weight broadcast's timeout).
    start_timeout_s: int = Field(900, gt=0)
    # vllm: how new weights reach the engine after an update. files: rank 0 writes safetensors under
    # <run_dir>/rollout/weights and the engine reloads them (the portable path: any shared file system); broadcast:
    # rank 0 sends each tensor to the engine's workers over a process group of their own (gloo on a CPU, NCCL on
    # CUDA, HCCL on an NPU; the engine reaches rank 0 at $MASTER_ADDR), nothing written after the start.
    weight_sync: Literal["files", "broadcast"] = "files"

    @model_validator(mode="after")
    def _vllm_keys(self) -> "RolloutConfig":
        if self.backend == "local":
            fields = type(self).model_fields
            changed = [k for k, f in fields.items() if k != "backend" and getattr(self, k) != f.default]
            if changed:
                raise ValueError(f"{changed[0]} is read by backend vllm only, and backend is local")
        if self.python and self.url:
            raise ValueError(
                "url and python are both set: a run attaches to the engine at url or starts one with python"
            )
        return self


class RLHFConfig(_Section):
    """Alignment (train_mode reward, dpo, grpo, ppo); each key says which stages read it."""

    # grpo, ppo: sampling
    generate_max_length: int = Field(16, gt=0, description="new tokens per response")
    # Sampling temperature of the rollouts (0: greedy).
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(0, ge=0, description="0: sample from the whole vocabulary")
    # grpo, ppo: the update
    ppo_epochs: int = Field(1, gt=0, description="passes over each rollout")
    mini_batch_size: int = Field(8, gt=0, description="responses per optimizer step within a rollout")
    # PPO's clip of the probability ratio (1 +- clip_range).
    clip_range: float = Field(0.2, gt=0)
    kl_coeff: float = Field(0.02, ge=0, description="weight of KL(policy || reference); 0 loads no reference")
    # ppo:
    # Clip of the critic's new values around the old ones.
    value_clip_range: float = Field(0.2, gt=0)
    # Weight of the critic's value loss.
    value_coeff: float = Field(0.1, ge=0)
    # Discount of rewards over a response's tokens (GAE's gamma).
    gamma: float = Field(1.0, ge=0, le=1)
    # GAE's lambda: the bias-variance trade of the advantages.
    lam: float = Field(0.95, ge=0, le=1)
    # Normalise the advantages over the batch (mean 0, std 1).
    whiten_advantages: bool = True
    target_kl: float | None = Field(None, gt=0, description="adaptive KL controller's target (None: fixed kl_coeff)")
    missing_eos_penalty: float = Field(
        1.0, ge=0, description="subtracted from the score of a response with no end token"
    )
    reward_model: str | None = None  # a train_mode reward run directory or checkpoint (None: the programmatic scorer)
    # shared: reference and reward model in the trainer's processes; separated: on scorer_ranks processes
    # of their own, beyond distributed.world_size (the job launches world_size + scorer_ranks)
    device_placement: Literal["shared", "separated"] = "shared"
    scorer_ranks: int = Field(1, gt=0, description="separated placement: processes holding reference and reward model")
    # grpo:
    group_size: int = Field(4, gt=1, description="responses sampled per prompt")
    clip_range_high: float | None = Field(None, gt=0, description="DAPO's clip-higher (None: clip_range)")
    # How token losses make the loss: per-sequence means (grpo), over the batch's tokens (bnpo), by a constant
    # (dr_grpo), over the group's tokens (dapo), as TRL names them.
    loss_aggregation: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    # advantages divided by the std of the group's scores (GRPO), of the batch's, or not at all (Dr. GRPO)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # grpo, ppo: the per-token KL(policy || reference) estimate (losses.kl_penalty); None: the stage's
    # peers' default, k3 in GRPO's loss (TRL), k1 in PPO's reward (TRL, verl); low_var_kl: verl's clamped k3
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] | None = None
    # dpo:
    # DPO's beta: how far the policy may move from the reference.
    beta: float = Field(0.1, gt=0)
    # DPO's label smoothing (the conservative DPO of TRL): the chance a preference is flipped.
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    # grpo, ppo: the engine that samples the rollouts
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)


# Which stages read which rlhf key (set to anything but its default in another stage: refused).
RLHF_KEYS = {
    "generate_max_length": ("grpo", "ppo"),
    "temperature": ("grpo", "ppo"),
    "top_k": ("grpo", "ppo"),
    "ppo_epochs": ("grpo", "ppo"),
    "mini_batch_size": ("grpo", "ppo"),
    "clip_range": ("grpo", "ppo"),
    "kl_coeff": ("grpo", "ppo"),
    "kl_estimator": ("grpo", "ppo"),
    "value_clip_range": ("ppo",),
    "value_coeff": ("ppo",),
    "gamma": ("ppo",),
    "lam": ("ppo",),
    "whiten_advantages": ("ppo",),
    "target_kl": ("ppo",),
    "missing_eos_penalty": ("ppo",),
    "reward_model": ("ppo",),
    "device_placement": ("ppo",),
    "scorer_ranks": ("ppo",),
    "group_size": ("grpo",),
    "clip_range_high": ("grpo",),
    "loss_aggregation": ("grpo",),
    "scale_rewards": ("grpo",),
    "beta": ("dpo",),
    "label_smoothing": ("dpo",),
    "rollout": ("grpo", "ppo"),
}


class ProfileConfig(_Section):
    """logging.profile: where a step's time goes (train/timing.py)."""

    # time each step's phases (data, forward, backward, optimizer), logged as time/<phase> beside step_time; it
    # synchronises the device at each phase's end, so it is off unless asked for
    enabled: bool = False
    trace: bool = False  # and record a torch.profiler trace of `steps` into <run>/profile/ (TensorBoard, Perfetto)
    steps: tuple[int, int] = (3, 4)  # the traced steps, first and last (inclusive)

    @model_validator(mode="after")
    def _window(self) -> "ProfileConfig":
        if not 1 <= self.steps[0] <= self.steps[1]:
            raise ValueError(f"steps: [first, last] with 1 <= first <= last, got {list(self.steps)}")
        return self


class LoggingConfig(_Section):
    """What is logged, evaluated and checkpointed, and how often."""

    # Steps between metrics.jsonl rows (loss, lr, grad_norm, throughput, MFU, memory).
    log_interval: int = Field(10, gt=0)
    # Steps between evaluations on the held-out split (and at the last step).
    eval_interval: int = Field(50, gt=0)
    # Validation set size in global batches (global_batch_size sequences each), whatever the layout.
    eval_batches: int = Field(8, gt=0)
    # train_mode sft: held-out samples whose final answer is generated greedily and scored (exact match)
    # at every evaluation; 0 turns it off.
    eval_exact_match: int = Field(0, ge=0)
    # train_mode pretrain and sft: lm-evaluation-harness tasks run on the live model at every evaluation (step 0, each
    # eval_interval, the last step), logged as eval/<task>/<metric>: canntrain's canntrain_<kind> tasks, tasks in
    # eval_include_path, or any the harness has data for on disk. SFT asks them in its chat template. Every rank
    # evaluates the same items (FSDP and TP stay in lockstep; not under pipeline, sequence or context parallelism).
    # Needs the eval extra (lm_eval).
    eval_tasks: list[str] = Field(default_factory=list)
    # Items of each of eval_tasks per evaluation (the harness's limit; canntrain_<kind> tasks are made this long).
    eval_tasks_limit: int = Field(32, gt=0)
    # A folder of the harness's YAML tasks (over local data) that eval_tasks may name.
    eval_include_path: str | None = None
    # Steps between checkpoints (and at the last step).
    ckpt_interval: int = Field(100, gt=0)
    # Complete checkpoints kept; older ones are pruned (damaged ones set aside, never deleted).
    keep_last: int = Field(3, gt=0)
    # A gradient norm over this many times the median of the last 20 steps' is reported (grad_norm_spikes)
    grad_spike_factor: float | None = Field(10.0, gt=1)
    # Experiment trackers sent every metrics.jsonl row's numbers (the same names, at the same step) and the resolved
    # recipe as the run's config, from rank 0: tensorboard (<run_dir>/tensorboard), wandb, mlflow, swanlab. Each
    # writes into the run directory unless its own environment names a server (WANDB_MODE/WANDB_API_KEY,
    # MLFLOW_TRACKING_URI, SWANLAB_MODE/SWANLAB_API_KEY); a resumed run continues the same tracker run
    # (train/trackers.py). Each needs its package: tensorboard, wandb, mlflow-skinny, swanlab.
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "swanlab"]] = Field(default_factory=list)
    # wandb, swanlab: the project; mlflow: the experiment the run goes to. None: experiment.name.
    tracker_project: str | None = None
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError(
                "tensorboard is now a tracker: logging.trackers: [tensorboard] (instead of tensorboard: true)"
            )
        return data

    @model_validator(mode="after")
    def _trackers(self) -> "LoggingConfig":
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if twice:
            raise ValueError(f"trackers names {twice[0]} twice")
        if self.tracker_project is not None and not set(self.trackers) - {"tensorboard"}:
            raise ValueError(
                "tracker_project is read by wandb, mlflow and swanlab, and logging.trackers has none of them"
            )
        return self


class Recipe(_Section):
    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    # The stage: pretrain, sft (with lora.enabled for LoRA), reward, dpo, grpo or ppo (canntrain_core/stages/).
    train_mode: Literal["pretrain", "sft", "reward", "dpo", "grpo", "ppo"] = "pretrain"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    rlhf: RLHFConfig = Field(default_factory=RLHFConfig)
    # A checkpoint directory, "auto" (newest complete checkpoint in the run directory) or null.
    resume_from: str | None = None
    # What loading noticed but did not reject (e.g. an override given twice); summary() prints them.
    _notes: list[str] = PrivateAttr(default_factory=list)

    def __eq__(self, other: object) -> bool:
        # Equal settings make equal recipes; notes say how a recipe was loaded, not what it is.
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, like every pydantic model

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(self._notes)

    @property
    def layout(self) -> Layout:
        """The parallel layout: the one reading of ``distributed.*`` (and the keys that shape it) that the
        validator, the estimator's setup, the device mesh and ``parallelize`` all take."""
        return Layout.from_recipe(self)

    @model_validator(mode="after")
    def _layout(self) -> "Recipe":
        problems = layout_problems(self.layout)  # what needs no model; the trainer checks the rest
        if self.distributed.context_parallel_size > 1 and self.train_mode not in ("pretrain", "sft"):
            problems.append(
                f"distributed.context_parallel_size > 1 splits the rows of pretraining and SFT; train_mode "
                f"{self.train_mode} does not split its sequences yet"
            )
        if problems:
            raise ValueError("invalid parallel layout: " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _stage_keys(self) -> "Recipe":
        """Keys of one stage set in a recipe of another would do nothing: refuse them."""
        if self.train_mode == "pretrain":  # (defaults are fine: a resolved recipe writes every key)
            default = DataConfig()
            sft_only = [f"data.{k}" for k in SFT_DATA_KEYS if getattr(self.data, k) != getattr(default, k)]
            sft_only += ["logging.eval_exact_match"] * (self.logging.eval_exact_match != 0)
            sft_only += ["lora.enabled"] * self.lora.enabled
            if sft_only:
                raise ValueError(f"{', '.join(sft_only)}: only train_mode sft reads these")
        if self.train_mode in ("reward", "dpo", "grpo", "ppo"):  # answers are never truncated, masked or packed
            default = DataConfig()
            unread = [
                f"data.{k}"
                for k in ("train_on", "truncation", "packing")
                if getattr(self.data, k) != getattr(default, k)
            ]
            unread += ["data.format"] * (self.train_mode in ("reward", "dpo") and self.data.format != default.format)
            if unread:
                raise ValueError(f"{', '.join(unread)}: train_mode {self.train_mode} does not read these")
        named = [self.data.source] if self.data.sources is None else [s.path for s in self.data.sources]
        if self.train_mode != "pretrain" and "stdlib" in named:
            what = "preference pairs" if self.train_mode in ("reward", "dpo") else "instruction records"
            raise ValueError(f"data.source: train_mode {self.train_mode} reads {what} (record files), not 'stdlib'")
        default = RLHFConfig()
        stray = [
            f"rlhf.{k}"
            for k, modes in RLHF_KEYS.items()
            if self.train_mode not in modes and getattr(self.rlhf, k) != getattr(default, k)
        ]
        if stray:
            raise ValueError(f"{', '.join(stray)}: train_mode {self.train_mode} does not read these")
        if self.train_mode in ("reward", "dpo", "grpo", "ppo") and not self.model.init_from:
            raise ValueError(
                f"model.init_from: train_mode {self.train_mode} starts from a fine-tuned model "
                "(a Hugging Face directory, e.g. `canntrain export` of an SFT run)"
            )
        if self.train_mode in ("reward", "dpo", "grpo", "ppo"):
            self._alignment_rules()
        if self.lora.enabled and not self.model.init_from:
            raise ValueError("lora.enabled: LoRA adapts a pretrained model; set model.init_from")
        if self.lora.load_in_4bit:
            why = qlora_problem(self)
            if why:
                raise ValueError(f"lora.load_in_4bit: {why}")
        return self

    @model_validator(mode="after")
    def _eval_tasks(self) -> "Recipe":
        """logging.eval_tasks runs where the trainer can generate and score in lockstep; its other keys need it."""
        lg, d = self.logging, self.distributed
        if not lg.eval_tasks:
            default = LoggingConfig()  # (a resolved recipe writes every key: defaults are fine)
            keys = ("eval_tasks_limit", "eval_include_path")
            unread = [f"logging.{k}" for k in keys if getattr(lg, k) != getattr(default, k)]
            if unread:
                raise ValueError(f"{', '.join(unread)}: read only with logging.eval_tasks")
            return self
        if self.train_mode not in ("pretrain", "sft"):
            raise ValueError(
                f"logging.eval_tasks: train_mode {self.train_mode} scores its held-out prompts itself (val_score); "
                "the harness runs in the loop of pretrain and sft (canntrain eval runs it on any run)"
            )
        split = [
            f"distributed.{k}"
            for k, on in (
                ("pipeline_parallel_size > 1", d.pipeline_parallel_size > 1),
                ("sequence_parallel", d.sequence_parallel),
                ("context_parallel_size > 1", d.context_parallel_size > 1),
            )
            if on
        ]
        if split:
            raise ValueError(
                f"logging.eval_tasks: not under {', '.join(split)} (a decode step of one token is not split over "
                "ranks); run canntrain eval on the run's checkpoints instead"
            )
        return self

    def _alignment_rules(self) -> None:
        d, h, mode = self.distributed, self.rlhf, self.train_mode
        if self.lora.enabled:
            raise ValueError(f"lora.enabled: train_mode {mode} trains full models here (LoRA is wired for sft)")
        if d.pipeline_parallel_size > 1:
            raise ValueError(
                f"distributed.pipeline_parallel_size: train_mode {mode} runs whole models per rank "
                "(scores, generation); use FSDP2 or TP"
            )
        if mode in ("grpo", "ppo") and d.sequence_parallel:
            raise ValueError(
                "distributed.sequence_parallel: generation feeds one token at a time, which "
                "cannot be split along the sequence; use plain TP"
            )
        if h.device_placement == "separated" and h.kl_coeff == 0 and not h.reward_model:
            raise ValueError(
                "rlhf.device_placement: separated moves the reference and the reward model to ranks "
                "of their own, and this recipe has neither (kl_coeff 0, no reward_model)"
            )
        if h.scorer_ranks != 1 and h.device_placement != "separated":
            raise ValueError("rlhf.scorer_ranks: only device_placement separated has scorer ranks")

    # ---- derived values, computed from the keys above, never set by hand ----
    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: micro-batch x data-parallel size x grad_accum_steps."""
        return self.data.batch_size * self.distributed.data_parallel_size * self.optim.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.data.seq_length

    def derived(self) -> dict[str, int]:
        return {
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "warmup_steps": self.optim.warmup,
            "total_tokens": self.tokens_per_step * self.optim.max_steps,
        }

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        body = yaml.safe_dump(self.to_dict(), sort_keys=False)
        derived = "".join(f"#   {k}: {v}\n" for k, v in self.derived().items())
        return body + "# derived (not read back):\n" + derived

    def summary(self) -> str:
        d = self.distributed
        lines = [
            f"recipe {self.experiment.name!r}: {self.train_mode} "
            f"{self.model.init_from or f'{self.model.family}/{self.model.preset}'} in {self.model.precision}",
            f"  parallel: world {d.world_size} = tp {d.tensor_parallel_size} x pp {d.pipeline_parallel_size} "
            f"x dp {d.data_parallel_size} x cp {d.context_parallel_size} (ep {d.expert_parallel_size}, "
            f"zero {d.zero_optimization})",
            f"  global batch = micro-batch {self.data.batch_size} x dp {d.data_parallel_size} x accum "
            f"{self.optim.grad_accum_steps} = {self.global_batch_size} sequences "
            f"= {self.tokens_per_step:,} tokens/step",
            f"  {self.optim.max_steps} steps, lr {self.optim.lr:g} ({self.optim.scheduler}, "
            f"{self.optim.warmup} warmup steps, min {self.optim.min_lr_ratio:g} x lr)",
        ]
        lines += [f"  {note}" for note in self._notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------- overrides


def _parse_value(raw: Any) -> Any:
    """CLI values arrive as strings; read them the way YAML would (1e-4, true, [0.9, 0.95])."""
    if not isinstance(raw, str):
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def _override_items(overrides: Mapping[str, Any] | list[str]) -> list[tuple[str, Any]]:
    """(dotted key, value as given) pairs, in order."""
    if isinstance(overrides, Mapping):
        return [(str(k).strip(), v) for k, v in overrides.items()]
    items = []
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-4")
        key, value = item.split("=", 1)
        items.append((key.strip(), value))
    return items


def _parse_overrides(overrides: Mapping[str, Any] | list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """The overrides as a dict (the later of a repeated key wins) and a note per repeated key."""
    given: dict[str, list[Any]] = {}
    for key, value in _override_items(overrides or []):
        given.setdefault(key, []).append(value)
    notes = []
    for key, values in given.items():
        if len(values) > 1:  # e.g. a --set in a launch script and another typed after it
            times = "twice" if len(values) == 2 else f"{len(values)} times"
            shown = ", ".join(map(str, values[:-1])) + f", then {values[-1]}"
            notes.append(f"override {key} given {times} ({shown}): using {values[-1]}")
    return {key: _parse_value(values[-1]) for key, values in given.items()}, notes


def parse_overrides(overrides: Mapping[str, Any] | list[str] | None) -> dict[str, Any]:
    """Accept {"optim.lr": 1e-4} (papermill) or ["optim.lr=1e-4"] (CLI) and return a dict."""
    return _parse_overrides(overrides)[0]


def _apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"override {dotted}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


# The cann-recipes-train articles' recipe keys and what each is called here: an "unknown key" among them says so.
# docs/command-line.md, "Coming from the cann-recipes-train articles", shows the same table.
ARTICLE_KEYS = {
    "model_name": "model.preset (a shape by name, e.g. llama2-70b) or model.init_from (a Hugging Face directory)",
    "model.config_path": "model.init_from (a directory with config.json) or model.preset",
    "data.path": "data.source",
    "distributed.parallel_mode": "nothing: the parallel sizes say the layout",
    "parallel_config": "distributed: tensor_model_parallel_size is distributed.tensor_parallel_size, "
    "pipeline_model_parallel_size distributed.pipeline_parallel_size, context_parallel_size and expert_parallel_size "
    "the same names under distributed",
    "training_config": "data.batch_size (batch_size_per_device), optim.grad_accum_steps (gradient_accumulation_steps), "
    "optim.lr (learning_rate), optim.warmup_steps, optim.max_steps (num_training_steps), optim.epochs "
    "(num_training_epochs), logging.ckpt_interval (save_interval_steps), lora (lora_config)",
    "rlhf_config": "rlhf with train_mode: ppo (stage); actor_model is model.init_from, reward_model rlhf.reward_model; "
    "kl_coeff, ppo_epochs, generate_max_length and device_placement the same names under rlhf",
    "batch_size_per_device": "data.batch_size",
    "gradient_accumulation_steps": "optim.grad_accum_steps",
    "learning_rate": "optim.lr",
    "warmup_steps": "optim.warmup_steps",
    "num_training_steps": "optim.max_steps",
    "num_training_epochs": "optim.epochs",
    "save_interval_steps": "logging.ckpt_interval",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_config": "lora",
}


def _format_errors(err: ValidationError, source: str, lines: dict[str, int], from_override: set[str]) -> str:
    msgs = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        # Pydantic puts model-level (cross-field) errors on the section itself.
        where = source
        if any(o == key or o.startswith(key + ".") for o in from_override):  # a whole unknown section from --set
            where = "override"
        elif key in lines:
            where = f"{source}, line {lines[key]}"
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + (
                f" (the cann-recipes-train articles' key; here: {ARTICLE_KEYS[key]})" if key in ARTICLE_KEYS else ""
            )
        elif key == "lora" and not isinstance(e.get("input"), dict):
            msg = "a section here: lora: {enabled: true, rank: 8} (the articles' lora: true, lora_rank: 8)"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
                msg += f" (got {e['input']!r})"
        msgs.append(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")
    return "invalid recipe:\n  " + "\n  ".join(msgs)


def no_model_named() -> RecipeError:
    """What a recipe that names neither model.preset nor model.init_from is told, before anything is built."""
    return RecipeError(
        "model: no model named; set model.preset (a shape by name, one of "
        f"{', '.join(sorted(PRESETS))}) or model.init_from (a Hugging Face model directory)"
    )


def load_recipe(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | list[str] | None = None,
) -> Recipe:
    """Read a YAML recipe, apply dotted overrides, validate, and return the Recipe.

    ``path=None`` starts from the defaults. Raises :class:`RecipeError` naming the file,
    the dotted key and, where known, the line.
    """
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    if path is not None:
        data, lines = read_recipe_file(Path(path), source, Recipe)
    data = copy.deepcopy(data)
    parsed, notes = _parse_overrides(overrides)
    for key, value in parsed.items():
        _apply_override(data, key, value)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, source, lines, set(parsed))) from None
    if path is not None and recipe.model.preset is None and not recipe.model.init_from:
        raise RecipeError(f"{source}: {no_model_named()}")  # (the defaults alone: when a model is built)
    recipe._notes = notes
    return recipe


def save_resolved(recipe: Recipe, run_dir: str | Path) -> Path:
    """Write recipe.resolved.yaml (what actually ran, defaults filled in) into the run directory."""
    out = Path(run_dir) / "recipe.resolved.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(recipe.to_yaml())
    return out
