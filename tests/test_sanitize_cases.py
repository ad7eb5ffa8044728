"""tools/sanitize_cases.py's log parsing on the CPU: reports are counted per case, the named false positives
(SUPPRESSIONS) are suppressed, and reports of the same kernels that are not those patterns still fail."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("sanitize_cases", ROOT / "tools" / "sanitize_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sc = _load()

_KERNEL = ("deep_indexer::paged_mqa_detail::PagedMqaKernel<(int)1, (int)64, (int)128, (int)64, (int)24, (int)4, "
           "(bool)0, float, (bool)0, (bool)0, (bool)1, (bool)1>")
# The FP4 q slot hand-off as racecheck printed it (H100): the Q producer's weights store against a math lane's read.
_SLOT_HANDOFF = (
    f"========= Error: Race reported between Write access at {_KERNEL}::stage_q_rows(const {_KERNEL}::Smem &, "
    "unsigned int, int, const unsigned char *, const int *, const float *, long, unsigned int &, unsigned int)"
    "+0x8200 in paged_mqa_logits.cuh:455\n"
    f"=========     and Read access at {_KERNEL}::math_warpgroups(const {_KERNEL}::Smem &, float *, long, "
    "unsigned int, unsigned int, deep_indexer::Tracer &)::[lambda(int) (instance 1)]::operator ()(int) const"
    "+0x2c50 in paged_mqa_logits.cuh:566 [140 hazards]")
# With split relu (H200): the q rows' stores (store_q_words, inlined in stage_q_rows) against build_pieces' reads.
_SLOT_PIECES = (
    "========= Error: Race reported between Read access at void deep_indexer::split_relu::build_pieces<(int)64, "
    "(int)128, (int)2>(const unsigned char *, unsigned char *, const float *, unsigned int *, int, int, unsigned int)"
    "+0x3200 in split_relu.cuh:66\n"
    "=========     and Write access at void deep_indexer::paged_fp4::store_q_words<(int)128, (bool)1>(unsigned char *, "
    "int, int, const unsigned int (&)[8])+0xbe90 in paged_fp4.cuh:134 [1280 hazards]\n"
    "=========     and Write access at void deep_indexer::paged_fp4::store_q_words<(int)128, (bool)1>(unsigned char *, "
    "int, int, const unsigned int (&)[8])+0xbec0 in paged_fp4.cuh:134 [1280 hazards]")
# Same kernel, other places: a race between the KV producer's tile issue and the math warpgroups.
_OTHER_RACE = (
    f"========= Error: Race reported between Write access at {_KERNEL}::issue_kv_tile(const {_KERNEL}::Smem &)"
    "+0x100 in paged_mqa_logits.cuh:470\n"
    f"=========     and Read access at {_KERNEL}::math_warpgroups(const {_KERNEL}::Smem &)+0x200 in "
    "paged_mqa_logits.cuh:600 [4 hazards]")


def _log(tmp_path, case: str, reports: list[str], finished: bool = True) -> str:
    lines = ["========= COMPUTE-SANITIZER", f"@@case {case}", *reports]
    if finished:
        lines.append(f"@@done {case}")
    lines.append("========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)")
    path = tmp_path / "racecheck.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_slot_handoff_is_suppressed_for_racecheck_only(tmp_path, capsys):
    log = _log(tmp_path, "paged_mqa_logits_fp4", [_SLOT_HANDOFF])
    assert sc.parse(log, "racecheck") == 0
    assert "clean, 1 suppressed" in capsys.readouterr().out
    assert sc.parse(log, "memcheck") == 1  # suppressions name their tool


def test_other_races_of_the_kernel_still_fail(tmp_path, capsys):
    log = _log(tmp_path, "paged_mqa_logits_fp4", [_SLOT_HANDOFF, _OTHER_RACE])
    assert sc.parse(log, "racecheck") == 1
    out = capsys.readouterr().out
    assert "1 reports, 1 suppressed" in out and "issue_kv_tile" in out


@pytest.mark.parametrize("report", [_SLOT_HANDOFF.replace("Write access", "Read access", 1)
                                    .replace("and Read access", "and Write access"),
                                    _SLOT_HANDOFF.split("\n")[1].replace("=========     and", "========= Error: "
                                                                         "Race reported between") + "\n" +
                                    _SLOT_HANDOFF.split("\n")[0].replace("========= Error: Race reported between",
                                                                         "=========     and")])
def test_slot_handoff_either_order(tmp_path, report):
    assert sc.parse(_log(tmp_path, "paged_mqa_logits_fp4", [report]), "racecheck") == 0


def test_slot_handoff_to_the_split_relu_pieces_is_suppressed(tmp_path, capsys):
    assert sc.parse(_log(tmp_path, "paged_mqa_logits_fp4", [_SLOT_PIECES, _SLOT_HANDOFF]), "racecheck") == 0
    assert "clean, 2 suppressed" in capsys.readouterr().out
    # a read of build_pieces against some other write is not this hand-off
    other = _SLOT_PIECES.replace("paged_fp4::store_q_words", "paged_fp4::something_else")
    assert sc.parse(_log(tmp_path, "paged_mqa_logits_fp4", [other]), "racecheck") == 1


def test_a_case_that_did_not_finish_fails(tmp_path):
    assert sc.parse(_log(tmp_path, "paged_mqa_logits_fp4", [], finished=False), "racecheck") == 1
