"""``xla_tp.generate``: greedy tokens equal transformers' CPU ``generate``, three programs per (batch, prompt
bucket, cache length) and none after, a decode step at the tensor-parallel minimum with its cache donated,
sampling inside the program, per-row end of sequence, left padding, streamers, and bad input refused
before anything compiles."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch_xla.debug.metrics as met
import transformers
from torch._dynamo.utils import counters

import xla_tp
from xla_tp import GenerationError
from xla_tp.compiles import compiled
from xla_tp.generation import audit_decode, run, uncaptured
from xla_tp.launch.data import ByteTokenizer
from xla_tp.zoo.cuda_llama import CudaLlama
from xla_tp.zoo.llama import Llama, LlamaArgs

from ..hf_tiny import LLAMA as TINY


def compiles() -> int:
    return compiled()


def aliases() -> list[float]:
    """The inputs each compiled program of this process updates in place, in compile order."""
    data = met.metric_data("InputOutputAliasCount")
    return [count for _, count in data[2]] if data else []


def ragged(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ``lengths`` tokens (ids 3-127: never the config's special ids) and their mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(3, 128, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids, mask


def pair(config: transformers.PretrainedConfig, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    return ref, xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=mesh)


@pytest.fixture(scope="module")
def llama():
    """A tiny HF Llama (8 heads, 4 kv heads) on data=2 x model=4, its first generation (cold) and the inputs
    each program that generation compiled updates in place."""
    ref, model = pair(transformers.LlamaConfig(**TINY), xla_tp.make_mesh(data=2, model=4))
    ids, mask = ragged([7, 4, 9], seed=0)
    before = aliases()
    first = run(model, ids, 24, attention_mask=mask)
    return ref, model, ids, mask, first, aliases()[len(before):]


def test_greedy_equals_cpu_generate_and_compiles_three_programs_then_none(llama):
    ref, model, ids, mask, first, aliased = llama
    assert torch.equal(first.sequences, ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False))
    # prefill (with the cache's allocation), the decode step's captured forward, the choice of the next token
    assert first.compiles == 3
    assert max(aliased) == 2 * 2  # the captured step updates keys and values in place (the prefill: none)
    assert (first.batch, first.prompt_bucket, first.cache_length) == (4, 16, 40)  # 3 rows on data=2
    ids2, mask2 = ragged([12, 16, 5], seed=1)  # the same bucket; fewer new tokens, the same cache length
    captures = counters["stats"]["unique_graphs"]
    again = run(model, ids2, 20, attention_mask=mask2)
    assert again.compiles == 0 and uncaptured(model) is None
    assert counters["stats"]["unique_graphs"] == captures  # a new cache replays the same capture: no new trace
    assert torch.equal(again.sequences, ref.generate(ids2, attention_mask=mask2, max_new_tokens=20, do_sample=False))
    # layers x (k, v) x [batch 4, kv heads 4, 40 slots, head_dim 8] float32; the batch over data=2, the kv heads
    # over model=4: one eighth of the cache on each device
    assert first.kv_bytes == 2 * 2 * 4 * 4 * 40 * 8 * 4 and first.kv_bytes_per_device * 8 == first.kv_bytes


def test_a_fixed_cache_length_serves_every_number_of_new_tokens(llama):
    ref, model, ids, mask, _, _ = llama
    short = run(model, ids, 3, attention_mask=mask, cache_length=64)
    long = run(model, ids, 40, attention_mask=mask, cache_length=64)
    assert (short.compiles, long.compiles, long.cache_length) == (3, 0, 64)
    assert torch.equal(long.sequences, ref.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False))


def test_decode_step_is_the_tensor_parallel_minimum_and_donates_its_cache(llama):
    _, model, ids, mask, _, _ = llama
    report = audit_decode(model, ids, 24, attention_mask=mask)
    # per layer attention and MLP outputs, the vocabulary-split embedding, the greedy choice, and the chosen
    # tokens gathered over the batch for the host to read: nothing else
    assert set(report.collectives) == {"all-reduce", "all-gather"} and report.count("all-reduce") == 2 * 2 + 2
    assert report.collectives["all-reduce"]["axes"] == ["model"] and report.collectives["all-gather"]["axes"] == ["data"]
    assert report.count("all-gather") == 1 and report.collectives["all-gather"]["bytes"] == 4 * 8  # [4] int64
    activation = 2 * 1 * 64 * 4  # [2 rows per data shard, 1, hidden] float32
    assert report.collectives["all-reduce"]["bytes"] == 5 * activation + 2 * 8
    aliased = met.metric_data("InputOutputAliasCount")[2]  # per compiled program, the last ones last
    assert max(count for _, count in aliased) >= 2 * 2  # a decode step updates keys and values in place


def test_sampling_runs_in_the_program_with_values_not_shapes(llama):
    ref, model, ids, mask, first, _ = llama
    import torch_xla.core.xla_model as xm
    xm.set_rng_state(1)
    hot = run(model, ids, 6, attention_mask=mask, do_sample=True, temperature=1.5, top_k=3)
    xm.set_rng_state(1)
    cooler = run(model, ids, 6, attention_mask=mask, do_sample=True, temperature=0.7, top_k=3)
    xm.set_rng_state(1)
    repeat = run(model, ids, 6, attention_mask=mask, do_sample=True, temperature=1.5, top_k=3)
    assert hot.compiles == 3 and cooler.compiles == 0 and repeat.compiles == 0
    assert torch.equal(hot.sequences, repeat.sequences)
    with torch.no_grad():
        top3 = ref(ids, attention_mask=mask).logits[:, -1].topk(3).indices
    firsts = hot.sequences[:, ids.shape[1]]
    assert all(t in row for t, row in zip(firsts.tolist(), top3.tolist()))
    greedy = first.sequences[:, : ids.shape[1] + 6]
    assert not torch.equal(hot.sequences, greedy)  # sampled, not the likeliest tokens
    assert torch.equal(run(model, ids, 6, attention_mask=mask, do_sample=True, top_p=1e-6).sequences, greedy)


def test_each_row_ends_at_its_own_eos_and_streams(llama):
    ref, model, ids, mask, first, _ = llama
    eos = int(first.sequences[0, ids.shape[1] + 2])  # row 0's third new token
    seen = []

    class Recorder:
        def put(self, value):
            seen.append(value.clone())

        def end(self):
            seen.append("end")

    ended = run(model, ids, 24, attention_mask=mask, eos_token_id=eos, pad_token_id=0, streamer=Recorder())
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ended.sequences, want) and ended.compiles == 0
    assert ended.sequences[0, ids.shape[1] + 2] == eos and (ended.sequences[0, ids.shape[1] + 3:] == 0).all()
    assert torch.equal(seen[0], ids) and seen[-1] == "end"
    assert torch.equal(torch.stack(seen[1:-1], dim=1), ended.sequences[:, ids.shape[1]:])


@pytest.mark.parametrize("config", [
    transformers.Qwen3Config(**TINY, head_dim=16),
    pytest.param(transformers.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
                                               layer_types=["sliding_attention", "sliding_attention",
                                                            "full_attention"]),
                 marks=pytest.mark.complete),  # a windowed cache: tests/program/test_lowering.py's quick test too
    pytest.param(transformers.Phi3Config(**TINY, partial_rotary_factor=0.5, pad_token_id=0),  # rotary on a slice
                 marks=pytest.mark.complete),                                                # of each head
    pytest.param(transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=8, vocab_size=128),  # ALiBi from the
                 marks=pytest.mark.complete),                                                     # 0/1 mask
], ids=["qwen3", "gemma3-sliding-window", "phi3-partial-rotary", "bloom-alibi"])
def test_other_families_equal_cpu_generate(config):
    ref, model = pair(config, xla_tp.make_mesh(data=2, model=4))
    ids, mask = ragged([5, 9], seed=2)  # 9 + 20 tokens: past Gemma's window of 8
    result = run(model, ids, 20, attention_mask=mask)
    assert torch.equal(result.sequences, ref.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    assert result.compiles == 3 and uncaptured(model) is None  # the decode step replays one captured program


@pytest.mark.complete  # 23 s: kept out of the quick tier (its margin under 8 minutes on CI)
def test_a_moe_model_generates_its_own_tokens_with_every_routed_token_kept():
    """Mixtral (4 experts, top 2) with default options: generation's tokens equal the CPU model's, nothing dropped
    (dropless: a slot per routed token, cheap at decode); a capacity the user sets applies to generation too."""
    ref, model = pair(transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
                      xla_tp.make_mesh(data=2, model=4))
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(2))
    result = run(model, ids, 12)
    assert torch.equal(result.sequences, ref.generate(ids, max_new_tokens=12, do_sample=False))
    assert [(layer["dropless"], layer["dropped"]) for layer in xla_tp.moe_report(model).values()] == [(True, 0)] * 2
    xla_tp.set_moe_options(model, capacity_factor=0.25)  # the user's choice holds in generation's programs too
    run(model, ids, 4)
    assert [(layer["dropless"], layer["capacity_factor"]) for layer in xla_tp.moe_report(model).values()] == [
        (False, 0.25)] * 2


def cpu_greedy(model: Llama, ids: torch.Tensor, mask: torch.Tensor, new: int) -> list[list[int]]:
    """The zoo Llama's greedy continuation of each row, recomputed on its whole sequence per token."""
    out = []
    with torch.no_grad():
        for row, keep in zip(ids, mask.bool()):
            seq = row[keep].tolist()
            for _ in range(new):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            out.append(seq[-new:])
    return out


def test_a_step_dynamo_cannot_capture_whole_is_traced_lazily_with_the_same_tokens():
    """A layer with a hook dynamo cannot trace (a graph break): the step runs lazily, and says why."""
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1})
    ref, model = pair(config, xla_tp.make_mesh(model=8))
    model.model.layers[0].register_forward_hook(lambda *_: torch._dynamo.graph_break())
    ids = torch.randint(3, 120, (1, 5), generator=torch.Generator().manual_seed(4))
    result = run(model, ids, 6)
    assert torch.equal(result.sequences, ref.generate(ids, max_new_tokens=6, do_sample=False))
    assert "graph_break" in uncaptured(model) or "graph break" in uncaptured(model).lower()
    assert run(model, ids, 6).compiles == 0


def test_zoo_llama_decodes_with_its_kv_cache_and_text_streamer(capsys):
    torch.manual_seed(0)
    ref = Llama(LlamaArgs(n_kv_heads=2, max_seq_len=48))  # 2 kv heads on model=4: the cache keeps them whole
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    ids, mask = ragged([6, 3], seed=3)
    result = run(model, ids, 10, attention_mask=mask)
    assert result.sequences[:, ids.shape[1]:].tolist() == cpu_greedy(ref, ids, mask, 10)
    assert result.compiles == 3 and result.kv_bytes_per_device * 2 == result.kv_bytes  # split by batch only
    prompt = torch.tensor([ByteTokenizer().encode("Hi there")])
    text = xla_tp.generate(model, prompt, max_new_tokens=5, streamer=transformers.TextStreamer(ByteTokenizer()))
    assert capsys.readouterr().out == ByteTokenizer().decode(text[0]) + "\n"


def test_bad_input_is_refused_before_anything_compiles(llama):
    _, model, ids, mask, _, _ = llama
    before = compiles()
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens=0: pass at least 1"),
        (dict(input_ids=torch.randint(3, 128, (1, 120)), attention_mask=None, max_new_tokens=16),
         "longer than the model's 128 positions"),
        (dict(input_ids=ids[0], attention_mask=None), "integer token ids [batch, length]"),
        (dict(input_ids=ids.float(), attention_mask=None), "got float32 (3, 9)"),
        (dict(attention_mask=mask[:, 1:]), "does not match input_ids"),
        (dict(attention_mask=torch.zeros_like(mask)), "mark no token"),
        (dict(do_sample=True, temperature=0.0), "positive temperature"),
        (dict(do_sample=True, top_p=1.5), "top_p=1.5"),
        (dict(eos_token_id="</s>"), "eos_token_id='</s>'"),
        (dict(cache_length=12), "plus max_new_tokens=8 does not fit in cache_length=12"),
    ]
    for change, message in cases:
        kwargs = {**dict(input_ids=ids, attention_mask=mask, max_new_tokens=8), **change}
        with pytest.raises(GenerationError, match=re.escape(message)):
            xla_tp.generate(model, **kwargs)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    models = [(plain, "is not parallelized: call xla_tp.parallelize_xla"),
              (transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                                    num_attention_heads=2, intermediate_size=64)),
               "is not a causal LM"),
              (CudaLlama(LlamaArgs()), "takes no KV cache"),
              (torch.nn.Linear(4, 4), "not a model xla_tp.generate can decode")]
    for other, message in models:
        with pytest.raises(GenerationError, match=message):
            xla_tp.generate(other, ids)
    assert compiles() == before
