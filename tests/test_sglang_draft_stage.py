"""The served draft stage: candidate tries merged into SGLang's head tree, laid out as SGLang's
verify reads it. No server: the layout is checked against SGLang's own tree builder and greedy
verify kernel (in a subprocess with SGLang's CPU engine, where sglang is installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from adaptivespec.plugins import get_plugin_host
from adaptivespec.sglang.draft_stage import ServedDraftStage
from adaptivespec.sglang.tree_layout import verify_layout
from adaptivespec.sglang.verification import parents_from_retrieve, retrieve_from_parents
from adaptivespec.strategies import CandidateSource
from adaptivespec.types import CandidateTrie, TreeShape

SHAPE = TreeShape(2, 2, 4)


def _head(tokens: list[list[int]], parents: list[list[int]]):
    """SGLang-laid-out head trees from per-request parent lists."""
    p = torch.tensor(parents)
    _, nxt, sib = retrieve_from_parents(p)
    return torch.tensor(tokens), nxt, sib


class ListSource(CandidateSource):
    """Proposes a fixed chain after every step; records what it was told."""

    name = "chain"

    def __init__(self, chain=(), score=0.5, extra=4):
        super().__init__()
        self.chain, self.score, self.extra = list(chain), score, extra
        self.seq: list[int] = []
        self.observed: list[list[int]] = []

    def reset(self, prompt_ids):
        self.seq = list(prompt_ids)

    def extend(self, tokens):
        self.seq += list(tokens)

    def propose(self):
        if not self.chain:
            return None
        trie = CandidateTrie()
        parent = -1
        for t in self.chain:
            parent = trie.add(parent, t, self.score)
        return trie

    def observe(self, trie, tokens):
        self.observed.append(list(tokens))

    def extra_slots(self):
        return self.extra


def test_layout_of_a_hand_built_tree():
    # root 0; 1, 2 below it; 3 below 1; 4 below 3; 5 padding
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]])
    lay = verify_layout(parents, torch.tensor([10]))
    mask = lay.custom_mask.view(6, 6)
    assert mask[4].tolist() == [True, True, False, True, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # padding sees only itself
    assert lay.positions.tolist() == [10, 11, 11, 12, 13, 10]
    assert lay.retrieve_next_token.tolist() == [[1, 3, -1, 4, -1, -1]]
    assert lay.retrieve_next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]
    assert lay.depth == 3
    full = verify_layout(parents, torch.tensor([3]), full_mask=True).custom_mask.view(6, 9)
    assert full[:, :3].all() and torch.equal(full[:, 3:], mask)
    # walked from the root, the links give back every real node's parent; the padding node is unreachable
    assert parents_from_retrieve(lay.retrieve_next_token[0].tolist(), lay.retrieve_next_sibling[0].tolist()) == [-1, 0, 0, 1, 3, -1]


def test_layout_refuses_parents_after_children():
    with pytest.raises(ValueError, match="after its parent"):
        verify_layout(torch.tensor([[-1, 2, 0]]), torch.tensor([1]))
    with pytest.raises(ValueError, match="root"):
        verify_layout(torch.tensor([[0, 0]]), torch.tensor([1]))


def test_retrieve_links_walk_back_to_the_parents_they_came_from():
    torch.manual_seed(0)
    for _ in range(20):
        n = 9
        parents = torch.tensor([[-1] + [int(torch.randint(0, i, ())) for i in range(1, n)] for _ in range(3)])
        index, nxt, sib = retrieve_from_parents(parents)
        assert index.tolist() == [list(range(b * n, (b + 1) * n)) for b in range(3)]
        for b in range(3):
            assert parents_from_retrieve(nxt[b].tolist(), sib[b].tolist()) == parents[b].tolist()
            for p in range(n):  # children chained in increasing node order
                kids, c = [], int(nxt[b, p])
                while c != -1:
                    kids.append(c)
                    c = int(sib[b, c])
                assert kids == [i for i in range(n) if parents[b, i] == p]


def test_merge_keeps_the_head_tree_and_fills_extra_rows_with_candidates():
    stage = ServedDraftStage(lambda: [ListSource(chain=[7, 8, 9, 10, 11, 12], extra=3)], extra_slots=0)
    assert stage.names == ["head", "chain"] and stage.extra_slots == 3 and stage.width(4) == 7
    tries = stage.propose([("a", [1, 2, 3], [5]), ("b", [4], [])])
    # request a: head root 5 -> 7, 6; 7 -> 8 (the chain's first two tokens are the head's)
    # request b: head root 4 -> 20, 21, 22
    tokens, nxt, sib = _head([[5, 7, 6, 8], [4, 20, 21, 22]], [[-1, 0, 0, 1], [-1, 0, 0, 0]])
    merged = stage.merge(head_tokens=tokens, next_token=nxt, next_sibling=sib, seq_lens=torch.tensor([4, 1]),
                         shape=SHAPE, tries=tries, rids=["a", "b"])
    assert merged is not None and merged.width == 7
    a_tok, a_par = merged.tokens[0].tolist(), merged.parents[0].tolist()
    # the head's 4 nodes, then 3 more chain nodes (9, 10, 11 under 8); 12 did not fit
    assert a_tok[:4] == [5, 7, 6, 8] and a_tok[4:] == [9, 10, 11]
    assert a_par == [-1, 0, 0, 1, 3, 4, 5]
    assert merged.origin[0][:4] == [0, 0b11, 0b01, 0b11] and merged.origin[0][4:] == [0b10] * 3
    b_tok, b_par = merged.tokens[1].tolist(), merged.parents[1].tolist()
    assert b_tok[:4] == [4, 20, 21, 22] and b_tok[4:7] == [7, 8, 9] and b_par[4:7] == [0, 4, 5]
    assert merged.layout.depth == 5 and merged.candidates == 6
    # request a's path 5 -> 7 -> 8 -> 9 -> 10 accepted, bonus 99: rows b * width + node
    accept = [[0, 1, 3, 4, 5, -1], [7, 11, -1, -1, -1, -1]]
    by = stage.observe(accept, [[7, 8, 9, 10, 99], [7, 98]])
    assert by == {"head": 2, "chain": 5}
    src = stage._requests["a"].sources[0]
    assert src.seq == [1, 2, 3, 5, 7, 8, 9, 10, 99] and src.observed == [[7, 8, 9, 10, 99]]
    assert len(stage._requests["a"].tokens) == 9


def test_padding_and_no_candidates():
    stage = ServedDraftStage(lambda: [ListSource(chain=[], extra=2)], extra_slots=0)
    tries = stage.propose([("a", [1], [2])])
    tokens, nxt, sib = _head([[2, 3, 4, 5]], [[-1, 0, 0, 1]])
    assert stage.merge(head_tokens=tokens, next_token=nxt, next_sibling=sib, seq_lens=torch.tensor([2]),
                       shape=SHAPE, tries=tries, rids=["a"]) is None
    assert stage.observe(None, [[3, 9]]) == {}
    assert stage._requests["a"].sources[0].seq == [1, 2, 3, 9]
    # one request with candidates, one without: the other is padded with unreachable rows
    stage = ServedDraftStage(lambda: [ListSource(chain=[30])], extra_slots=0)
    tries = stage.propose([("a", [1], []), ("b", [2], [])])
    tries[1] = [None]
    tokens, nxt, sib = _head([[1, 3, 4, 5], [2, 6, 7, 8]], [[-1, 0, 0, 1], [-1, 0, 1, 2]])
    merged = stage.merge(head_tokens=tokens, next_token=nxt, next_sibling=sib, seq_lens=torch.tensor([1, 1]),
                         shape=SHAPE, tries=tries, rids=["a", "b"])
    assert merged.tokens[1].tolist()[:4] == [2, 6, 7, 8] and merged.parents[1].tolist()[4:] == [-1] * 4
    reach = parents_from_retrieve(merged.layout.retrieve_next_token[1].tolist(), merged.layout.retrieve_next_sibling[1].tolist())
    assert reach[4:] == [-1] * 4


def test_a_request_is_caught_up_kept_through_a_lag_or_rebuilt_when_its_tokens_changed():
    stage = ServedDraftStage(lambda: [ListSource(chain=[1])], extra_slots=0)
    stage.propose([("a", [1, 2], [3])])
    first = stage._requests["a"].sources[0]
    stage.propose([("a", [1, 2], [3])])
    assert stage._requests["a"].sources[0] is first  # in sync: kept
    stage.propose([("a", [1, 2], [3, 4, 5])])  # two tokens emitted while the stage did not run: caught up
    assert stage._requests["a"].sources[0] is first and first.seq == [1, 2, 3, 4, 5]
    stage.propose([("a", [1, 2], [3, 4])])  # the server's lists lag what the sources saw (overlap): kept
    assert stage._requests["a"].sources[0] is first and first.seq == [1, 2, 3, 4, 5]
    stage.propose([("a", [1, 2], [3, 7, 5, 6])])  # not the same sequence (a retraction): rebuilt
    again = stage._requests["a"].sources[0]
    assert again is not first and again.seq == [1, 2, 3, 7, 5, 6]
    stage.propose([("b", [9], [])])
    assert set(stage._requests) == {"b"}  # requests that left the batch are forgotten


def test_stage_from_a_config_builds_its_registered_sources(tmp_path):
    from adaptivespec.config import load_config

    path = tmp_path / "h.yaml"
    path.write_text("sources:\n  - name: retrieval\n    extra_slots: 5\n")
    stage = ServedDraftStage.from_config(load_config(path), get_plugin_host())
    # constrained requests add the grammar source (8 extra rows), as in the torch runtime
    assert stage.names == ["head", "retrieval", "grammar"] and stage.extra_slots == 8
    stage.propose([("free", [1, 2, 3], [])])
    assert stage._requests["free"].extra == 5  # free text: only retrieval's rows
    stage = ServedDraftStage.from_config(load_config(path, ["generation.grammar_draft=false"]), get_plugin_host())
    assert stage.names == ["head", "retrieval"] and stage.extra_slots == 5
    assert stage.widths([TreeShape(3, 4, 8), TreeShape(2, 2, 4)]) == [8, 9, 12, 13]  # 4 or all 5 extra rows
    assert stage.width(8, 1) == 12 and stage.width(8, 5) == 13 and stage.width(8) == 13
    assert ServedDraftStage.from_config(load_config(None), get_plugin_host()) is None


_SGLANG_CHECK = textwrap.dedent("""
    import json, sys, torch
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, build_tree_kernel_efficient, organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
    from adaptivespec.sglang.tree_layout import verify_layout
    from adaptivespec.sglang.verification import parents_from_retrieve
    torch.manual_seed(0)
    out = {"layout": [], "verify": []}
    def draft(bs, topk, steps, ndt, vocab=50):
        p = torch.rand(bs, topk).sort(descending=True).values
        idx = torch.randint(0, vocab, (bs, topk))
        hidden, scores, sl, tl, pl = torch.zeros(bs, 4), None, [], [], []
        for i in range(steps):
            _, hidden, scores, info = select_top_k_tokens(i, p, idx, hidden, scores, topk)
            sl.append(info[0]); tl.append(info[1]); pl.append(info[2])
            p = torch.rand(bs * topk, topk).sort(descending=True).values
            idx = torch.randint(0, vocab, (bs * topk, topk))
        return organize_draft_results(sl, tl, pl, ndt)
    for bs, topk, steps, ndt in [(3, 4, 3, 8), (2, 2, 4, 6), (1, 4, 6, 12)]:
        par, tsi, dt = draft(bs, topk, steps, ndt)
        seq = torch.tensor([5, 9, 13][:bs])
        for mode in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
            m, pos, ri, rn, rs, _ = build_tree_kernel_efficient(torch.arange(bs), par, tsi, dt, seq, int(seq.sum()),
                                                                topk, steps, ndt, tree_mask_mode=mode)
            parents = torch.tensor([parents_from_retrieve(rn[b].tolist(), rs[b].tolist()) for b in range(bs)])
            lay = verify_layout(parents, seq, full_mask=mode == TreeMaskMode.FULL_MASK)
            out["layout"].append(all(torch.equal(a, b) for a, b in [(m, lay.custom_mask), (pos, lay.positions),
                (ri, lay.retrieve_index), (rn, lay.retrieve_next_token), (rs, lay.retrieve_next_sibling)]))
    # SGLang's greedy verify on a merged tree: root 0 -> head 1, 2; 1 -> 3; source chain 4 -> 5 -> 6 under root
    parents = torch.tensor([[-1, 0, 0, 1, 0, 4, 5, -1]])
    tokens = torch.tensor([[100, 11, 12, 13, 21, 22, 23, 100]])
    lay = verify_layout(parents, torch.tensor([7]))
    for target in ([21, 0, 0, 0, 22, 23, 99, 0], [11, 13, 0, 98, 0, 0, 0, 0], [50, 0, 0, 0, 0, 0, 0, 0]):
        predict = torch.zeros(8, dtype=torch.int32)
        accept = torch.full((1, lay.depth + 1), -1, dtype=torch.int32)
        n = torch.zeros(1, dtype=torch.int32)
        verify_tree_greedy_func(predicts=predict, accept_index=accept, accept_token_num=n, candidates=tokens,
                                retrieve_index=lay.retrieve_index, retrieve_next_token=lay.retrieve_next_token,
                                retrieve_next_sibling=lay.retrieve_next_sibling,
                                target_predict=torch.tensor([target]), topk=-1)
        k = int(n[0])
        out["verify"].append([accept[0].tolist(), [int(predict[i]) for i in accept[0].tolist()[: k + 1]]])
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (install it with scripts/install_sglang_cpu.sh: a Xeon with AMX, or a CPU with AVX-512 bf16 such as an AMD EPYC)")
def test_layouts_equal_sglangs_own_and_its_greedy_verify_walks_merged_trees():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run([sys.executable, "-c", _SGLANG_CHECK], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0 and "sgl_kernel" in proc.stderr:
        pytest.skip(f"SGLang's CPU kernels do not load here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layout"] == [True] * 6  # QLEN and FULL masks, positions, retrieve arrays
    # the target continues with the source's chain: all three accepted, then the bonus
    assert out["verify"][0] == [[0, 4, 5, 6], [21, 22, 23, 99]]
    # the head's branch: 11 then 13, bonus 98
    assert out["verify"][1] == [[0, 1, 3, -1], [11, 13, 98]]
    # nothing matches: the root only, its bonus
    assert out["verify"][2] == [[0, -1, -1, -1], [50]]


def test_with_the_heads_scores_a_source_node_takes_a_weak_head_nodes_row():
    stage = ServedDraftStage(lambda: [ListSource(chain=[7, 30, 31], score=0.6, extra=1)], extra_slots=0)
    tries = stage.propose([("a", [1], [5])])
    tokens, nxt, sib = _head([[5, 7, 6, 8]], [[-1, 0, 0, 1]])
    # node 2 (token 6) is a weak sibling: 0.05; the chain 7 -> 30 -> 31 scores 0.6 each level
    scores = torch.tensor([[0.9, 0.05, 0.5]])
    merged = stage.merge(head_tokens=tokens, next_token=nxt, next_sibling=sib, seq_lens=torch.tensor([2]),
                         shape=SHAPE, tries=tries, rids=["a"], head_scores=scores)
    # budget 4 + 1: the chain 7 -> 30 -> 31 displaced the weak head node 6
    assert merged.tokens[0].tolist() == [5, 7, 8, 30, 31] and merged.parents[0].tolist() == [-1, 0, 1, 1, 3]
    assert merged.origin[0] == [0, 3, 1, 2, 2] and merged.width == 5  # 4 + the one extra row (extra_slots 1)
    head_first = ServedDraftStage(lambda: [ListSource(chain=[7, 30, 31], score=0.6, extra=1)], extra_slots=0)
    t2 = head_first.propose([("a", [1], [5])])
    m2 = head_first.merge(head_tokens=tokens, next_token=nxt, next_sibling=sib, seq_lens=torch.tensor([2]),
                          shape=SHAPE, tries=t2, rids=["a"])
    assert m2.tokens[0].tolist()[:5] == [5, 7, 6, 8, 30]  # head kept whole, one source row


def test_a_constrained_request_is_drafted_from_the_grammar_state_its_server_keeps():
    """The grammar source reads the request's matcher (SGLang's, advanced by SGLang): after
    ``{"name": "Al"`` the schema forces ``, "age": ``; the view never advances it."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from adaptivespec.config import load_config
    from adaptivespec.constraints import Constraint, GrammarBackend
    from adaptivespec.errors import AdaptiveSpecError
    from adaptivespec.models import embedded_folder
    from adaptivespec.response_format import ResponseFormat

    try:
        tok = AutoTokenizer.from_pretrained(str(embedded_folder(verbose=False)))
    except AdaptiveSpecError as exc:
        pytest.skip(str(exc))
    backend = GrammarBackend(tok, 49152)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "status": {"enum": ["student", "retired"]}},
              "required": ["name", "age", "status"]}
    server_side = backend.constraint(ResponseFormat(type="json_schema", schema=schema))  # what SGLang keeps
    out = tok.encode('{"name": "Al"', add_special_tokens=False)
    server_side.accept(out)
    stage = ServedDraftStage.from_config(load_config("configs/hybrid.yaml"), get_plugin_host())
    stage.view = lambda matcher: Constraint.following(backend, matcher)
    prompt = tok.encode("Describe a person as JSON.", add_special_tokens=False)
    tries = stage.propose([("r", prompt, out, server_side.matcher), ("free", prompt, out)])
    grammar = stage.names.index("grammar") - 1
    drafted = tries[0][grammar]
    assert drafted is not None and tries[1][grammar] is None  # the free-text request: nothing from a grammar
    assert drafted.parents == list(range(-1, len(drafted) - 1))  # one chain below the root
    assert tok.decode(drafted.tokens) == ', "age":'  # the canonical tokens, the last one cut (it merges with what follows)
    assert stage._requests["r"].extra == 8 and stage._requests["free"].extra == 8  # hybrid's retrieval: 8 too
    assert not server_side.matcher.is_terminated() and server_side.matcher.find_jump_forward_string() == ', "age": '
