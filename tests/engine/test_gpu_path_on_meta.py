"""The GPU path's Python, run on the meta device (tests/engine/meta_steps.py): the forward pass makes no host
sync and takes no CPU tensor, its kernel launches per decode step are counted, every Triton variant a step
launches is one the start-up warm-up compiles, and what crosses from the host each step is small and pinned."""

from __future__ import annotations

import torch
from meta_steps import LLAMA_8B, META, DeviceWork, MetaEngine, recorded, step_of

from engine.config import ModelConfig, SamplingParams
from engine.sampler import _apply_penalties
from engine.sequence import Request
from kernels.triton_variants import distinct_variants

# SmolLM2-135M's attention (the demo model): 9 query heads over 3 KV heads, head_dim 64, vocab 49,152
SMOLLM2_1_LAYER = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True,
)


def launches_of(engine: MetaEngine, step) -> tuple[DeviceWork, list]:
    on_device = engine.on_device(step)
    with recorded() as (work, triton):
        engine.forward(*on_device)
    return work, triton


def test_a_step_of_an_8b_llama_runs_on_meta_tensors_so_its_forward_needs_no_host_sync():
    engine = MetaEngine(LLAMA_8B)
    for step in (step_of([1024] * 8, []), step_of([37, 4000], [(300, 300), (64, 2048)])):
        work, triton = launches_of(engine, step)
        assert work.cpu_inputs == []  # nothing the forward takes is still on the host
        assert triton, "the Triton kernels were launched (recorded)"


def test_launches_per_decode_step_of_an_8b_shaped_llama():
    """Per layer: 4 GEMMs, 2 RMSNorms, rotary, the KV write, attention (two kernels under split-K) and SiLU;
    then the final norm, the LM head's GEMM and float cast, the sampled rows' gather, the embedding and the
    sampler. CUDA graphs would replay all of them as one launch per batch size."""
    engine = MetaEngine(LLAMA_8B)
    counts = {}
    for name, step in (("batch 64 x 1024 tokens", step_of([1024] * 64, [])),
                       ("batch 8 x 4096 tokens (split-K)", step_of([4096] * 8, []))):
        work, triton = launches_of(engine, step)
        counts[name] = (sum(work.ops.values()), len(triton))
    layers = LLAMA_8B.num_hidden_layers
    assert counts["batch 64 x 1024 tokens"] == (4 * layers + 4, 6 * layers + 2)
    assert counts["batch 8 x 4096 tokens (split-K)"] == (4 * layers + 4, 7 * layers + 2)
    for name, (aten, triton) in counts.items():
        print(f"8B-shaped Llama ({layers} layers), decode {name}: {aten + triton} launches "
              f"({aten} torch ops, {triton} Triton)")


def test_every_triton_variant_a_step_launches_is_compiled_by_the_start_up_warm_up():
    limits = dict(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192)
    for config in (LLAMA_8B.model_copy(update={"num_hidden_layers": 1}), SMOLLM2_1_LAYER):
        engine = MetaEngine(config)
        with recorded() as (_, warm_up):
            engine.warm_up(**limits)
        steps = [step_of([context] * batch, []) for batch in (1, 3, 5, 33, 256) for context in (16, 17, 1000, 2600, 8192)]
        steps += [step_of([50, 700], [(q, c)]) for q, c in ((1, 1), (7, 7), (100, 300), (2048, 2048), (512, 8192))]
        seen = []
        for step in steps:
            seen += launches_of(engine, step)[1]
        compiled = distinct_variants(warm_up)
        missed = [launch.describe() for key, launch in distinct_variants(seen).items() if key not in compiled]
        assert missed == [], missed
        print(f"{config.num_attention_heads}/{config.num_key_value_heads} heads, head_dim {config.head_dim}: "
              f"the warm-up compiles {len(compiled)} Triton variants")
        for launch in compiled.values():
            print("  " + launch.describe())


def test_penalties_send_the_penalised_rows_token_ids_not_a_vocabulary_wide_table():
    vocab = 151936
    seqs = []
    for i in range(4):
        seq = Request(f"r{i}", None, list(range(1, 40)), SamplingParams(repetition_penalty=1.2, presence_penalty=0.5,
                                                                         frequency_penalty=0.3)).seqs[0]
        seq.token_ids += [7, 7, 9]  # three output tokens
        seqs.append(seq)
    work = DeviceWork()
    with torch.inference_mode(), work:
        penalised = _apply_penalties(torch.zeros(4, vocab, device=META), seqs)
    assert penalised.shape == (4, vocab)
    assert 0 < work.largest_cpu_tensor < 1000  # the token ids; the [num_seqs, vocab] counts are built on the device


def test_step_inputs_are_pinned_before_their_asynchronous_copy_to_the_gpu(monkeypatch):
    pinned, copied = set(), []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned.add(id(tensor)) or tensor)
    real_to = torch.Tensor.to

    def to(tensor, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            copied.append((id(tensor), kwargs.get("non_blocking", False)))
            return tensor
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    step_of([100, 200], [(30, 30)]).to(torch.device("cuda", 0))
    assert len(copied) == 9  # ids, positions, sampled rows and six attention tensors
    assert all(non_blocking and tensor in pinned for tensor, non_blocking in copied)
