"""JournalStream (recovery's one-pass read) gives exactly scan_journal's verdict: the
same payloads, the same ScanResult and torn-tail cut, the same JournalCorruptError --
and never hands out a record at or past the damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.persistence import journal as jmod
from rallypoint.persistence.journal import (
    HEADER_SIZE,
    JournalCorruptError,
    JournalStream,
    list_segments,
    scan_journal,
)

from test_persistence_faults import REC, make_journal, payload

N = 100
SEG = 4096  # 35 records of REC bytes per segment: 3 segments of 35 and one of 30


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Two journals of N records in 4 KiB segments: closed cleanly, and as a kill -9
    leaves it (only then is a damaged tail a torn write)."""
    out = {}
    for crash in (False, True):
        d = tmp_path_factory.mktemp("tpl")
        make_journal(d, N, segment_bytes=SEG, crash=crash)
        out[crash] = d
    return out


def location(d: Path) -> dict[int, tuple[int, int]]:
    """LSN -> (segment's first LSN, byte offset) in the undamaged template."""
    loc = {}
    for first, p in list_segments(d):
        size = p.stat().st_size
        for k in range(size // REC):
            loc[first + k] = (first, k * REC)
    return loc


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def by_scan(d: Path, after: int, cut: bool):
    try:
        res = scan_journal(d, after, cut_torn_tail=cut)
    except JournalCorruptError as e:
        return "err", (str(e), e.path, e.offset, e.reason), None
    return "ok", [p for _, p in res.iter_records()], res


def by_stream(d: Path, after: int, cut: bool):
    s = JournalStream(d, after, cut_torn_tail=cut)
    got = []
    try:
        for p in s.iter_payloads():
            got.append(bytes(p))
    except JournalCorruptError as e:
        assert s.result is None
        return "err", (str(e), e.path, e.offset, e.reason), got
    return "ok", got, s.result  # (ok: the payloads and the ScanResult)


def damage(d: Path, how: str, seg: int, pos: int) -> None:
    segs = list_segments(d)
    first, p = segs[seg % len(segs)]
    data = bytearray(p.read_bytes())
    pos = pos % max(1, len(data))
    if how == "flip":
        data[pos] ^= 0x5A
        p.write_bytes(bytes(data))
    elif how == "truncate":
        p.write_bytes(bytes(data[:pos]))
    elif how == "zero_from":
        p.write_bytes(bytes(data[:pos]) + bytes(len(data) - pos))
    elif how == "delete":
        p.unlink()
    elif how == "junk_tail":
        p.write_bytes(bytes(data) + b"\xff" * (1 + pos % 40))
    elif how == "zero_tail":
        p.write_bytes(bytes(data) + bytes(4096))


def check_same(tmp: Path, src: Path, after: int, cut: bool, monkeypatch) -> tuple:
    a, b = tmp / "a", tmp / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    ka, va, ra = by_scan(a, after, cut)
    monkeypatch.setattr(jmod, "STREAM_BATCH", 3)  # batch edges everywhere
    kb, vb, rb = by_stream(b, after, cut)
    assert ka == kb, (va, vb)
    if ka == "ok":
        assert vb == va
        assert rb == _rebased(ra, a, b)
    else:
        assert vb == tuple(x.replace(str(a), str(b)) if isinstance(x, str) else x for x in va)
    assert files(a) == files(b)  # the same cut (or nothing modified)
    return ka, vb, rb  # ("err", the error's (str, path, offset, reason), payloads handed out)


def _rebased(res, a: Path, b: Path):
    """``res`` (a ScanResult of dir a) with every path moved to dir b."""
    import copy
    import dataclasses

    def move(x):
        if isinstance(x, Path):
            return b / x.relative_to(a)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)})
        if isinstance(x, list):
            return [move(y) for y in x]
        return x

    return move(copy.deepcopy(res))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(crash=st.booleans(),
       how=st.sampled_from(["none", "flip", "truncate", "zero_from", "delete", "junk_tail", "zero_tail"]),
       seg=st.integers(0, 3), pos=st.integers(0, SEG),
       after=st.sampled_from([0, 1, 20, 35, 36, 50, 70, 99, 100, 120]),
       cut=st.booleans())
def test_stream_gives_the_scans_verdict(tmp_path_factory, monkeypatch, templates, crash, how, seg, pos, after, cut):
    src = templates[crash]
    tmp = tmp_path_factory.mktemp("case")
    shutil.copytree(src, tmp / "src")
    damage(tmp / "src", how, seg, pos)
    kind, err, handed = check_same(tmp, tmp / "src", after, cut, monkeypatch)
    if kind == "ok":
        return
    # Refused: what was handed out before the error is records after+1, after+2, ...
    # intact, every one of them before the damage (in an earlier segment, or at a
    # lower offset of the damaged one).
    assert handed == [payload(i) for i in range(after + 1, after + 1 + len(handed))]
    _msg, path, offset, _reason = err
    name = Path(path).name
    if handed and name.endswith(".wal"):
        loc = location(src)
        damaged = (int(name[:20]), offset)
        assert all(loc[i] < damaged for i in range(after + 1, after + 1 + len(handed))), (damaged, len(handed))


def test_corrupt_middle_hands_out_nothing_past_the_damage(tmp_path, monkeypatch):
    make_journal(tmp_path / "src", N, segment_bytes=SEG)
    segs = list_segments(tmp_path / "src")
    first, p = segs[1]
    with open(p, "r+b") as f:  # record first + 4 (LSN 40): a bad CRC, good records follow
        f.seek(4 * REC + HEADER_SIZE + 10)
        f.write(b"!")
    kind, err, handed = check_same(tmp_path, tmp_path / "src", 0, True, monkeypatch)
    assert kind == "err" and "bad CRC" in err[3] and err[2] == 4 * REC
    assert handed == [payload(i) for i in range(1, first + 4)]
    s = JournalStream(tmp_path / "src", 0)
    got = []
    with pytest.raises(JournalCorruptError):
        for x in s.iter_payloads():
            got.append(x)
    assert got == [payload(i) for i in range(1, first + 4)]  # LSN 1..39, not 40 nor after


def test_stream_is_read_once(tmp_path):
    make_journal(tmp_path, 3)
    s = JournalStream(tmp_path, 0)
    assert list(s.iter_payloads()) == [payload(i) for i in (1, 2, 3)]
    assert s.result.next_lsn == 4 and s.result.record_count == 3
    with pytest.raises(RuntimeError):
        list(s.iter_payloads())


def test_an_abandoned_stream_unmaps_its_segment(tmp_path):
    """A replay that stops part-way (an apply raised) leaves no segment mapped: the
    torn-tail cut or a repair may shorten the file next."""
    import gc
    import mmap

    def open_maps():
        return {id(o): o for o in gc.get_objects() if type(o) is mmap.mmap and not o.closed}

    make_journal(tmp_path, 50)
    s = JournalStream(tmp_path, 0)
    it = s.batches()
    before = open_maps()
    next(it)
    maps = [o for k, o in open_maps().items() if k not in before]
    assert maps  # the segment is mapped while it is read
    it.close()
    assert all(m.closed for m in maps)
