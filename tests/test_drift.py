"""What the documents promise, held to the code (issue 37, item 12): configuration names every bad entry
of a list at once, as docs/configuration.md says; ``check`` tells a name DNS does not have from a name
without addresses; a ``dns+http://`` name /etc/hosts holds resolves as the system resolver would have it;
the GPU examples clean the embeddings they write."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from epd_middleware import EPDConfig, EPDMiddleware
from epd_middleware._discovery import Discovery, hosts_entries
from epd_middleware._http import HTTPClient
from epd_middleware._metrics import Stats
from epd_middleware._pool import PoolPolicy, ServerPool
from epd_middleware.cli import check_fleet
from epd_middleware.config import ConfigurationError

from .dns_server import dns_server
from .fakes import FakeEngine


def problems_of(env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigurationError) as raised:
        EPDConfig.from_env(env)
    return raised.value.problems


def test_every_bad_url_of_a_list_is_named_at_once() -> None:
    """Before: the first bad URL of EPD_ENCODERS was named and the others were not, so an operator fixed
    one, restarted, and met the next."""
    problems = problems_of(
        {
            "EPD_ENCODERS": "http://enc-0:abc,http://enc-1:8001,ftp://enc-2:8001,http://user:secret@enc-3:8001",
            "EPD_PREFILL": "http://p-0:99999,http://p-1:8100?x=1",
        }
    )
    assert problems == [
        "EPD_ENCODERS: encoder URL 'http://enc-0:...': the port must be a number from 1 to 65535",
        "EPD_ENCODERS: encoder URL 'ftp://enc-2:8001' is not an http(s) or dns+http(s) URL with a host",
        "EPD_ENCODERS: encoder URL 'http://...@enc-3:8001' carries credentials (user:password@); give "
        "the servers' key as encoder_api_key (EPD_ENCODER_API_KEY) instead",
        "EPD_PREFILL: prefill URL 'http://p-0:99999': the port must be a number from 1 to 65535",
        "EPD_PREFILL: prefill URL 'http://p-1:8100?x=1' must not carry a query or fragment",
    ]
    with pytest.raises(ConfigurationError) as raised:
        EPDMiddleware(FakeEngine().app(), encoders=["http://enc-0:x", "http://enc-1:8001", "http://"])
    assert raised.value.problems == [
        "encoders: encoder URL 'http://enc-0:...': the port must be a number from 1 to 65535",
        "encoders: encoder URL 'http://' is not an http(s) or dns+http(s) URL with a host",
    ]


def test_every_bad_entry_of_the_other_lists_is_named_at_once() -> None:
    problems = problems_of(
        {
            "EPD_ENCODERS": "http://enc-0:8001",
            "EPD_SCHEDULER_ALLOW": "10.0.0.0/33,10.0.0.0/8,nonsense",
            "EPD_DNS_NAMESERVERS": "dns.example:53,10.0.0.10:53,10.0.0.11",
            "EPD_PATHS": "v1/chat/completions,/v1/x,v1/y",
        }
    )
    assert [problem.split(":")[0] for problem in problems] == [
        "EPD_SCHEDULER_ALLOW",
        "EPD_SCHEDULER_ALLOW",
        "EPD_DNS_NAMESERVERS",
        "EPD_DNS_NAMESERVERS",
        "EPD_PATHS",
        "EPD_PATHS",
    ], problems
    named = " ".join(problems)
    for entry in ("v1/chat/completions", "v1/y", "10.0.0.0/33", "nonsense", "dns.example:53", "10.0.0.11"):
        assert repr(entry) in named, entry


# --- check: a name DNS does not have, and a name without addresses ---


@pytest.mark.anyio
async def test_check_tells_a_missing_name_from_a_name_without_addresses() -> None:
    """Before: "DNS answered no address" for both. NXDOMAIN is a name DNS does not have, which on
    Kubernetes is also how its DNS answers a headless Service with no ready pod (the Kubernetes DNS
    specification since 2018); NOERROR without an address is a name that exists and names no server (a
    namespace's name, say). The operator's next step differs."""
    async with dns_server({"epd.svc.test": []}) as dns:
        config = EPDConfig(
            encoders=("dns+http://epd-encoder.svc.test:8001",),
            prefill=("dns+http://epd.svc.test:8100",),
            dns_nameservers=(dns.address,),
        )
        client = HTTPClient(connect_timeout=1)
        reports, problems = await check_fleet(config, client, None)
        await client.aclose()
    assert reports == []
    missing, empty = problems
    assert missing.startswith(
        "encoder dns+http://epd-encoder.svc.test:8001: DNS has no such name epd-encoder.svc.test (NXDOMAIN)"
    )
    assert "a headless Service none of whose pods is ready" in missing
    assert "kubernetes.io/service-name=epd-encoder" in missing
    assert empty.startswith(
        "prefill dns+http://epd.svc.test:8100: DNS knows the name epd.svc.test but it has no A or AAAA record"
    )


# --- dns+http:// names the hosts file holds ---


@pytest.mark.anyio
async def test_a_name_the_hosts_file_holds_resolves_without_asking_dns() -> None:
    """Before: dnspython reads resolv.conf alone, so dns+http://localhost:8001 asked DNS, got NXDOMAIN and
    the pool stayed empty, where every other client on the machine (the system resolver) reads /etc/hosts
    first."""
    async with dns_server({"enc.test": ["127.0.0.9"]}) as dns:
        pool = ServerPool("encoder", PoolPolicy(1), Stats())
        discovery = Discovery(
            pool, ("dns+http://localhost:8001", "dns+http://enc.test:8002"), 60, 1, (dns.address,)
        )
        await discovery.refresh()
        asked = dns.queries
    assert "http://127.0.0.1:8001" in pool.members
    assert "http://127.0.0.9:8002" in pool.members
    assert asked == 2  # enc.test, A and AAAA: localhost was never asked
    assert discovery.snapshot()["dns+http://localhost:8001"]["empty_answer"] is None


@pytest.mark.anyio
async def test_the_hosts_file_is_read_as_the_system_resolver_reads_it(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# comment line\n"
        "10.0.0.2   Enc-A.Local enc-b  # trailing comment\n"
        "fd00::2    enc-a.local\n"
        "10.0.0.1   enc-a.local\n"
        "fe80::1%eth0 enc-scoped\n"
        "not-an-address enc-c\n"
        "10.0.0.3\n"
    )
    assert await hosts_entries(str(hosts)) == {
        "enc-a.local": ("10.0.0.1", "10.0.0.2", "fd00::2"),
        "enc-b": ("10.0.0.2",),
    }
    assert await hosts_entries(str(tmp_path / "missing")) == {}


# --- The GPU examples clean the embeddings they write ---

EXAMPLES = Path(__file__).parent.parent / "examples"
HELPER = EXAMPLES / "gpu" / "ec_cache.sh"
# A stand-in for `vllm serve`: an encoder (ec_producer) writes one embedding where ECExampleConnector
# would (<shared_storage_path>/<mm_hash>/encoder_cache.safetensors) and ends, which ends the launch
# script's wait -n; every other server serves until it is killed.
FAKE_VLLM = r"""#!/usr/bin/env bash
config=""
while [ $# -gt 0 ]; do
  if [ "$1" = --ec-transfer-config ]; then config=$2; fi
  shift
done
dir=$(printf %s "$config" | sed -n 's/.*"shared_storage_path":"\([^"]*\)".*/\1/p')
case "$config" in
  *'"ec_role":"ec_producer"'*)
    mkdir -p "$dir/hash-$$"
    echo embedding > "$dir/hash-$$/encoder_cache.safetensors"
    echo "$dir/hash-$$" >> "$WRITTEN"
    sleep 0.5 ;;
  *) exec sleep 30 ;;
esac
"""
GPU_SCRIPTS = {
    "launch_1e_1pd.sh": {},
    "launch_e_p_d.sh": {"NUM_ENCODERS": "1"},
    "launch_ne_mpd.sh": {"N_ENC": "1", "N_PD": "1"},
}


def test_every_example_that_shares_embeddings_through_files_cleans_them() -> None:
    """Before: the GPU scripts made /dev/shm/epd-ec-cache and filled it, memory, with every embedding
    the encoders wrote, and nothing deleted one, while the servers ran or after."""
    for path in sorted(EXAMPLES.rglob("*.sh")):
        text = path.read_text()
        if "ECExampleConnector" not in text or path.parent.name != "gpu" or path == HELPER:
            continue
        assert path.name in GPU_SCRIPTS, f"{path.name}: run it below too"
        assert 'source "$(dirname "$0")/ec_cache.sh"' in text, path.name
        # The sweeper runs before any server writes; the exit trap empties the directory.
        assert text.index("\nec_cache_start\n") < text.index("vllm serve"), path.name
        [trap] = re.findall(r"^trap '(.*)' EXIT INT TERM$", text, re.MULTILINE)
        assert trap.endswith("|| true; ec_cache_stop"), (path.name, trap)
        assert 'mkdir -p "$EC_DIR"' not in text, path.name  # ec_cache_start makes it, and remembers
    # The CPU example keeps its storage in a directory of its own, removed at exit where it made it.
    cpu = (EXAMPLES / "cpu" / "launch_e_p_d.sh").read_text()
    [trap] = re.findall(r"^trap '(.*)' EXIT INT TERM$", cpu, re.MULTILINE)
    assert 'rm -rf "$DIR"' in trap


@pytest.mark.parametrize("script", sorted(GPU_SCRIPTS))
@pytest.mark.parametrize("existing", [False, True])
def test_a_gpu_example_leaves_no_embedding_behind(tmp_path: Path, script: str, existing: bool) -> None:
    bin_dir, written = tmp_path / "bin", tmp_path / "written"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    ec_dir = tmp_path / "ec"
    if existing:  # the operator's own directory: what is not an embedding stays, and so does it
        (ec_dir / "hash-old").mkdir(parents=True)
        (ec_dir / "hash-old" / "encoder_cache.safetensors").write_text("old")
        (ec_dir / "notes.txt").write_text("mine")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "EC_DIR": str(ec_dir),
        "WRITTEN": str(written),
        "MODEL": "m",
        **GPU_SCRIPTS[script],
    }
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(EXAMPLES / "gpu" / script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # The sweeper and the servers were stopped, not waited out (the stand-in servers sleep 30 s).
    assert time.monotonic() - started < 20
    [embedding] = written.read_text().split()
    assert embedding.startswith(str(ec_dir))  # an embedding was written where the servers share them
    if existing:
        assert sorted(p.name for p in ec_dir.iterdir()) == ["notes.txt"]
    else:
        assert not ec_dir.exists()


def test_the_sweep_deletes_old_embeddings_and_keeps_young_ones(tmp_path: Path) -> None:
    """What the sweeper does every EC_SWEEP_SECONDS while the servers run, as the cluster's CronJob
    (deploy/kubernetes/base/ec-cache-cleanup.yaml) does."""
    old = time.time() - 30 * 60
    for name, age in (("hash-old", old), ("hash-young", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "encoder_cache.safetensors").write_text(name)
        if age is not None:
            os.utime(tmp_path / name / "encoder_cache.safetensors", (age, age))
    (tmp_path / "empty-old").mkdir()
    os.utime(tmp_path / "empty-old", (old, old))
    (tmp_path / "empty-young").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    os.utime(tmp_path / "notes.txt", (old, old))
    script = f'set -euo pipefail; EC_DIR="{tmp_path}"; EC_SWEEP_SECONDS=0.2; source "{HELPER}"\n'
    script += "ec_cache_start; sleep 1.5; kill $EC_SWEEPER; wait\n"
    result = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": os.environ["PATH"], "EC_MAX_AGE_MINUTES": "10"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert left == [
        "empty-young",
        "hash-old",  # emptied now: its own age starts again
        "hash-young",
        "hash-young/encoder_cache.safetensors",
        "notes.txt",
    ]
