"""A replica's log copied back under its cap: the cut falls between lines, so the redaction that
follows sees every secret whole (a secret cut in two would pass through it in pieces)."""

from cluster.replica import capped_log

SECRET = "hf_abcdefghijklmnopqrstuvwxyz0123456789"


def test_a_log_under_the_cap_comes_back_whole(tmp_path):
    log = tmp_path / "server.log"
    log.write_bytes(b"INFO one\nINFO two\n")
    assert capped_log(log, 1000) == (b"INFO one\nINFO two\n", 18)
    assert capped_log(tmp_path / "missing.log", 1000) == (b"", 0)


def test_the_cap_never_cuts_inside_a_line_so_a_secret_is_redacted_whole(tmp_path):
    lines = [f"INFO request {i} ok" for i in range(200)]
    # a secret on the lines where the head's and the tail's byte cuts land
    for at in (10, 11, 12, 13, 14, 185, 186, 187, 188, 189, 190):
        lines[at] = f"WARNING auth header Bearer {SECRET} refused"
    text = "\n".join(lines) + "\n"
    log = tmp_path / "server.log"
    log.write_text(text)
    for cap in range(800, 1400, 37):  # many cut positions, inside and between lines
        data, size = capped_log(log, cap)
        assert size == len(text.encode())
        copied = data.decode().replace(SECRET, "<redacted>")
        assert "hf_" not in copied and "0123456789" not in copied, cap
        kept = [line for line in copied.splitlines() if line and not line.startswith("[mtp-canary:")]
        assert kept and all(line.replace("<redacted>", SECRET) in lines for line in kept), cap
        assert copied.startswith("INFO request 0 ok") and copied.endswith("INFO request 199 ok\n")
        cut = next(line for line in copied.splitlines() if line.startswith("[mtp-canary:"))
        assert int(cut.split()[1]) == size - len(data) + len(cut) + 2  # the bytes left out, counted right
        assert len(data) <= cap + len(cut) + 2
