"""blockdraft's vLLM plugin without vLLM: which classes it can give the layer states (read from source
text laid out as vLLM's model folder), and what its rewritten decoder forward computes, run on a toy
decoder next to a brute-force record of every layer's input stream. The real classes are judged in
vLLM itself by the reference suite (reference/test_vllm_capture.py)."""

from __future__ import annotations

import textwrap
from itertools import islice

import pytest
import torch

from blockdraft.engines.vllm.plugin import AUX, INDEX, Plan, Source, can_capture, rewrite_forward

STANDARD = '''
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        if get_pp_group().is_first_rank:
            hidden_states = self.embed_input_ids(input_ids) * self.scale
            residual = None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
'''
NO_RESIDUAL = '''
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states = self.embed_input_ids(input_ids) * self.scale
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states = layer(positions=positions, hidden_states=hidden_states)
        hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
'''


class Mixin:  # vLLM's EagleModelMixin, as interfaces.py writes it
    aux_hidden_state_layers = ()

    def _maybe_add_hidden_state(self, aux, layer_idx, hidden_states, residual):
        if layer_idx in self.aux_hidden_state_layers:
            aux.append(hidden_states + residual if residual is not None else hidden_states)
        return aux


class Pipeline:
    is_first_rank = is_last_rank = True


class Layer(torch.nn.Module):
    """A fused-residual layer as vLLM writes them: returns (delta, residual), the stream being their sum."""

    def __init__(self, seed):
        super().__init__()
        self.w = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.w.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, positions=None, hidden_states=None, residual=None):
        stream = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(self.w(stream)), stream


class Toy(Mixin):
    start_layer, end_layer, scale = 0, 4, 3.0

    def __init__(self, with_residual=True):
        self.layers = [Layer(k) for k in range(4)]
        self.with_residual = with_residual

    def embed_input_ids(self, ids):
        return torch.nn.functional.one_hot(ids, 8).float()

    def norm(self, h, r):
        s = h + r
        return s / s.norm(dim=-1, keepdim=True), s

    def final_layernorm(self, h):
        return h / h.norm(dim=-1, keepdim=True)


def compiled(source: str):
    ns = {"islice": islice, "get_pp_group": Pipeline, "IntermediateTensors": dict, "torch": torch}
    exec(rewrite_forward(source), ns)
    return ns["forward"]


def streams(toy: Toy, ids: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    """Brute force: the stream entering each layer, and the last layer's output (ids 0..4)."""
    x = toy.embed_input_ids(ids) * toy.scale
    out = [x]
    for layer in toy.layers:
        delta, stream = layer(hidden_states=x) if not fused else layer(hidden_states=x, residual=None)
        x = delta + stream if fused else delta
        out.append(x)
    return out


def test_the_rewritten_forward_records_the_stream_entering_each_asked_layer():
    fwd = compiled(STANDARD)
    toy, ids = Toy(), torch.tensor([1, 5, 2, 7])
    plain = fwd(toy, ids, None)  # no layer asked: the forward is untouched
    toy.aux_hidden_state_layers = (1, 3, 4)
    out, aux = fwd(toy, ids, None)
    want = streams(toy, ids, fused=True)
    assert torch.equal(out, plain)
    assert len(aux) == 3
    for got, k in zip(aux, (1, 3, 4)):  # id k: the input of layer k; id n: the last layer's output
        torch.testing.assert_close(got, want[k])
    toy.aux_hidden_state_layers = (0,)  # the embedding (id 0), recorded before the loop
    torch.testing.assert_close(fwd(toy, ids, None)[1][0], want[0])


def test_a_layer_without_a_residual_stream_records_its_hidden_state():
    fwd = compiled(NO_RESIDUAL)
    toy, ids = Toy(), torch.tensor([3, 3, 0])

    for layer in toy.layers:
        layer.forward = lambda positions=None, hidden_states=None, _w=layer.w: torch.tanh(_w(hidden_states))
    toy.aux_hidden_state_layers = (2, 4)
    out, aux = fwd(toy, ids, None)
    x, want = toy.embed_input_ids(ids) * toy.scale, []
    for layer in toy.layers:
        want.append(x)
        x = layer(hidden_states=x)
    want.append(x)
    torch.testing.assert_close(aux[0], want[2])
    torch.testing.assert_close(aux[1], want[4])
    assert AUX in rewrite_forward(NO_RESIDUAL) and INDEX in rewrite_forward(NO_RESIDUAL)


def write(tmp_path, name, text):
    p = tmp_path / f"{name}.py"
    p.write_text(textwrap.dedent(text))


def test_the_reader_says_which_classes_it_can_change_and_why_not(tmp_path):
    write(tmp_path, "interfaces", "class SupportsEagle3: pass\n")
    body = textwrap.indent(textwrap.dedent(STANDARD), "    ")
    write(tmp_path, "good", "from .interfaces import SupportsEagle3\n"
                            f"class GoodModel:\n{body}\n"
                            "class GoodForCausalLM:\n    def __init__(self, *, vllm_config, prefix=''):\n"
                            "        self.model = GoodModel(vllm_config=vllm_config)\n"
                            "    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):\n"
                            "        hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)\n"
                            "        return hidden_states\n"
                            "class NativeForCausalLM(GoodForCausalLM, SupportsEagle3): pass\n"
                            "class BusyForCausalLM(GoodForCausalLM):\n"
                            "    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):\n"
                            "        return self.model(input_ids, positions) * 2\n"
                            "class TransformerForCausalLM:\n    def __init__(self):\n        self.transformer = 1\n")
    write(tmp_path, "reuse", "from .good import GoodModel\nclass Reuse(GoodModel):\n    pass\n"
                             "class ReuseForCausalLM:\n    def __init__(self, *, vllm_config, prefix=''):\n"
                             "        self.model = Reuse(vllm_config=vllm_config)\n"
                             "    def forward(self, *a):\n        return self.model(*a)\n")
    src = Source(tmp_path)
    assert src.plan("good", "GoodForCausalLM") == Plan("good", "GoodModel", rewrite=True)
    assert src.plan("reuse", "ReuseForCausalLM") == Plan("reuse", "Reuse", rewrite=True)  # forward inherited
    assert src.supports_eagle3("good", "NativeForCausalLM") and not src.supports_eagle3("good", "GoodForCausalLM")
    assert "does more than return" in can_capture(tmp_path, "good", "BusyForCausalLM")[1]
    assert "builds no `self.model" in can_capture(tmp_path, "good", "TransformerForCausalLM")[1]
    assert can_capture(tmp_path, "good", "GoodForCausalLM") == (True, "")


@pytest.mark.parametrize("source,why", [
    (STANDARD.replace("for layer in islice(self.layers", "for layer in islice(self.blocks"), "no loop over self.layers"),
    (STANDARD.replace("            residual = None\n", "").replace(
        '            residual = intermediate_tensors["residual"]\n', ""), "not set before the layer loop"),
    (STANDARD.replace("        return hidden_states\n", "        print(hidden_states)\n"), "does not end by returning"),
])
def test_forwards_of_another_shape_are_refused_with_the_reason(source, why):
    with pytest.raises(ValueError, match=why):
        rewrite_forward(source)


def test_layers_that_take_their_input_as_the_residual_record_the_hidden_state_alone(tmp_path):
    """Cohere's parallel blocks start with `residual = hidden_states` and return (stream, their input):
    there the stream between layers is hidden_states alone, and h + r would count the input twice."""
    body = textwrap.indent(textwrap.dedent(STANDARD), "    ")
    for name, first in (("fused", "        if residual is None:\n            residual = hidden_states\n"),
                        ("parallel", "        residual = hidden_states\n")):
        write(tmp_path, name, f"class Block:\n    def forward(self, positions, hidden_states, residual):\n{first}"
                              "        return hidden_states, residual\n"
                              f"class Model:\n    def __init__(self, config):\n        self.layers = [Block()]\n{body}\n"
                              "class LM:\n    def __init__(self, *, vllm_config, prefix=''):\n"
                              "        self.model = Model(vllm_config)\n"
                              "    def forward(self, *a):\n        return self.model(*a)\n")
    assert Source(tmp_path).plan("fused", "LM").summed
    assert not Source(tmp_path).plan("parallel", "LM").summed
    fwd = compiled_with(STANDARD, summed=False)
    toy, ids = Toy(), torch.tensor([2, 4])
    toy.aux_hidden_state_layers = (2,)
    out, (aux,) = fwd(toy, ids, None)
    x, r = toy.embed_input_ids(ids) * toy.scale, None
    for layer in toy.layers[:2]:  # the loop as written; what enters layer 2 is its hidden state alone
        x, r = layer(hidden_states=x, residual=r)
    torch.testing.assert_close(aux, x)
    assert not torch.allclose(aux, x + r)


def compiled_with(source: str, summed: bool):
    ns = {"islice": islice, "get_pp_group": Pipeline, "IntermediateTensors": dict, "torch": torch}
    exec(rewrite_forward(source, summed=summed), ns)
    return ns["forward"]
