"""The batch script's decisions after a preflight, a hang or a dead node (jobs/slurm/script.py), run
for real by bash with stand-in Slurm commands: what it writes to events.log, which scontrol
calls it makes (requeue held, ExcNodeList, release) and how it exits. The same script runs on
the local Slurm cluster in tests/test_hang_slurm.py."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import write_libraries
from jobs.config import load_config
from common.rundir import HangLine, RunDir
from jobs.slurm.script import Pins, render_sbatch
from common.rundir import HANG_EXIT, PREFLIGHT_EXIT
from common.rundir import PREFLIGHT_ENV, PREFLIGHT_FAILED_FILE

# Stand-ins: scontrol and sinfo answer from files in $FAKE, srun runs the preflight's and the
# training step's stand-ins ($FAKE/node.sh, allreduce.sh, train.sh), every call is logged.
SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE/scontrol.log"
case "$1 $2" in
  "show hostnames") if [ "$3" = "$SLURM_JOB_NODELIST" ]; then tr ' ' '\\n' < "$FAKE/nodes"; echo; else
                      tr ',' '\\n' <<< "$3"; fi | sed '/^$/d' ;;
  "show job") echo "JobId=$SLURM_JOB_ID JobState=RUNNING ExcNodeList=$(cat "$FAKE/excluded" 2>/dev/null || echo '(null)')" ;;
esac
exit 0
"""
SINFO = """#!/bin/bash
echo "$*" >> "$FAKE/sinfo.log"
if [[ " $* " == *" -n "* ]]; then  # the nodes of -n's host list: the job's, or a comma list
  list=$(for a in "$@"; do [ "$prev" = -n ] && echo "$a"; prev=$a; done)
  if [ "$list" = "$SLURM_JOB_NODELIST" ]; then names=$(cat "$FAKE/nodes"); else names=${list//,/ }; fi
  for n in $names; do awk -v n="$n" '$1 == n' "$FAKE/sinfo"; done
else
  cat "$FAKE/sinfo"
fi
"""
SRUN = """#!/bin/bash
case " $* " in
  *" slipway-verify "*) while [ "${1#--}" != "$1" ]; do shift; done
    for n in $(cat "$FAKE/nodes"); do SLURMD_NODENAME=$n "$@"; done; exit 0 ;;
  *" trainer.preflight node "*)
    [[ " $* " == *" --kill-on-bad-exit=0 "* ]] && exec bash "$FAKE/node.sh"
    # As Slurm does under KillOnBadExit=1 (the local cluster's, and many sites'): the first task
    # that fails ends the step, and the reports the other nodes had not printed yet are lost.
    bash "$FAKE/node.sh" | sed '/ fail: /q'; exit 5 ;;
  *" trainer.preflight allreduce "*) exec bash "$FAKE/allreduce.sh" ;;
  *" trainer.plot "*) while [ "${1#--}" != "$1" ]; do shift; done; exec "$@" ;;  # the curves, for real
  *" --overlap "*) exit 0 ;;  # the node helper, container removals and sweeps: nothing here
esac
exec bash "$FAKE/train.sh"
"""
ALL_OK = 'for n in $(cat "$FAKE/nodes"); do echo "slipway-preflight $n ok: stand-in"; done'
ALLREDUCE_OK = 'echo "slipway-preflight-allreduce ok: all-reduce of 4 MiB over 4 ranks on 2 node(s) (gloo): 1.00 GB/s"'


class Job:
    """A run directory, the batch script of a 2-node job of 2 ranks each, and its stand-ins."""

    def __init__(self, tmp_path: Path, *overrides: str, nodes: str = "node1 node2",
                 partition: str = "node1 alloc\nnode2 alloc\nnode3 idle", pins: Pins = Pins()):
        self.run_dir = tmp_path / "p" / "runs" / "r1"
        self.run_dir.mkdir(parents=True)
        self.fake = tmp_path / "fake"
        bin_dir = self.fake / "bin"
        bin_dir.mkdir(parents=True)
        for name, text in (("scontrol", SCONTROL), ("sinfo", SINFO), ("srun", SRUN)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        (self.fake / "nodes").write_text(nodes)
        (self.fake / "sinfo").write_text(partition + "\n")
        self.script("node.sh", ALL_OK)
        self.script("allreduce.sh", ALLREDUCE_OK)
        self.script("train.sh", "exit 0")
        cfg = load_config("configs/tiny_cpu.yaml", ["run.name=r1", "slurm.nodes=2", "parallel.dp=4", *overrides])
        self.cfg = cfg
        self.text = render_sbatch(cfg, RunDir(self.run_dir, tmp_path / "p"), cfg.container, pins)
        write_libraries(self.run_dir, cfg.container)

    def script(self, name: str, body: str) -> None:
        (self.fake / name).write_text(body + "\n")

    def run(self, restart: int = 0) -> int:
        env = {"PATH": f"{self.fake / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "41",
               "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_JOB_PARTITION": "debug",
               "SLURM_RESTART_COUNT": str(restart), "HOME": str(self.fake), "FAKE": str(self.fake),
               "RUN_DIR": str(self.run_dir)}
        # A file, not a pipe: the heartbeat loop's `sleep` outlives the script (Slurm would end it).
        with (self.fake / "out").open("w") as out:
            proc = subprocess.run(["bash", "-c", self.text], env=env, cwd=self.fake, timeout=60, stdout=out,
                                  stderr=subprocess.STDOUT)
        self.out = (self.fake / "out").read_text()
        return proc.returncode

    def events(self) -> list[str]:
        return [line.split(" ", 3)[3] for line in (self.run_dir / "events.log").read_text().splitlines()]

    def scontrol(self) -> list[str]:
        return [c for c in (self.fake / "scontrol.log").read_text().splitlines() if not c.startswith("show ")]

    def hang_dumps(self, tag: str, ranks: dict[str, list[int]], step: int = 7, limit: str = "20",
                   late: tuple[int, ...] = ()) -> str:
        """A training stand-in that leaves the dumps the given ranks would write (those in `late`
        noticed long past their deadline: frozen until Slurm's teardown), then fails."""
        lines = ['mkdir -p "$RUN_DIR/hangs"']
        for node, rs in ranks.items():
            for r in rs:
                line = (HangLine(r, node, step, 61.0, 20.0, on_time=False) if r in late
                        else HangLine(r, node, step, 20.0, float(limit), on_time=True)).line()
                lines.append(f'echo {shlex.quote(line)} > "$RUN_DIR/hangs/{tag}-{node}-{r}.txt"')
        lines.append("exit 1")
        return "\n".join(lines)


def test_a_node_that_fails_its_preflight_is_excluded_and_the_job_requeued(tmp_path):
    job = Job(tmp_path)
    job.script("node.sh", 'echo "slipway-preflight node1 ok: fine"\n'
                          'echo "slipway-preflight node2 fail: run directory /x is not reachable"\nexit 5')
    job.script("train.sh", "echo TRAINING >> \"$FAKE/trained\"")
    assert job.run() == 0, job.out
    events = job.events()
    assert "preflight failed on node2: run directory /x is not reachable" in events
    assert "retry 1/2 (preflight): requeueing without node2 (excluded nodes: node2)" in events
    assert job.scontrol() == ["requeuehold 41", "update JobId=41 ExcNodeList=node2", "release 41"]
    assert not (job.fake / "trained").exists()  # no training on a node that failed
    assert events[-1] == "end exit 0"


def test_a_node_that_fails_first_does_not_silence_the_others(tmp_path):
    """node2 fails before node1 has printed its report: node1 must still be heard (the node step
    opts out of KillOnBadExit), and only node2 is left out."""
    job = Job(tmp_path)
    job.script("node.sh", 'echo "slipway-preflight node2 fail: 1.0 MiB free at /c (where checkpoints go)"\n'
                          'echo "slipway-preflight node1 ok: fine"\nexit 5')
    assert job.run() == 0, job.out
    events = job.events()
    assert [e for e in events if e.startswith("preflight failed")] == [
        "preflight failed on node2: 1.0 MiB free at /c (where checkpoints go)"], events
    assert "retry 1/2 (preflight): requeueing without node2 (excluded nodes: node2)" in events


def test_exclusions_add_up_over_retries(tmp_path):
    job = Job(tmp_path, partition="node1 alloc\nnode2 alloc\nnode3 idle\nnode4 idle")
    (job.fake / "excluded").write_text("node3")  # an earlier retry excluded it
    (job.run_dir / "events.log").write_text("2026-01-01T00:00:00+00:00 job 41 retry 1/2 (hang): requeueing "
                                            "without node3 (excluded nodes: node3)\n")
    job.script("node.sh", 'echo "slipway-preflight node1 ok: fine"')  # node2 sends nothing
    assert job.run(restart=1) == 0, job.out
    events = job.events()
    assert any(e.startswith("preflight failed on node2: no report: the step ended after ") for e in events), events
    assert "start on node[1-2] (restart 1), failure retries 1/2, time-limit requeues 0/20" in events
    assert "retry 2/2 (preflight): requeueing without node2 (excluded nodes: node2,node3)" in events
    assert "update JobId=41 ExcNodeList=node2,node3" in job.scontrol()


def test_no_retry_without_enough_other_nodes(tmp_path):
    job = Job(tmp_path, partition="node1 alloc\nnode2 alloc\nnode3 down*")
    job.script("node.sh", 'echo "slipway-preflight node1 ok: fine"\necho "slipway-preflight node2 fail: bad GPU"')
    assert job.run() == PREFLIGHT_EXIT, job.out
    assert ("not retrying (preflight): without node2 partition debug has 1 usable node(s), the job needs 2"
            in job.events())
    assert job.scontrol() == []


def test_retries_stop_at_max_retries(tmp_path):
    job = Job(tmp_path, "slurm.max_retries=1")
    (job.run_dir / "events.log").write_text("2026-01-01T00:00:00+00:00 job 41 retry 1/1 (preflight): requeueing\n"
                                            "2026-01-01T00:00:00+00:00 job 40 retry 1/1 (preflight): another job\n")
    job.script("node.sh", 'echo "slipway-preflight node1 fail: full"\necho "slipway-preflight node2 fail: full"')
    assert job.run(restart=1) == PREFLIGHT_EXIT, job.out
    assert "not retrying (preflight): slurm.max_retries (1) reached" in job.events()
    assert job.scontrol() == []


def test_every_node_failing_alike_is_retried_on_the_same_nodes(tmp_path):
    job = Job(tmp_path)
    job.script("node.sh", 'echo "slipway-preflight node1 fail: 0.00 GiB free"\n'
                          'echo "slipway-preflight node2 fail: 0.00 GiB free"')
    assert job.run() == 0, job.out
    assert "retry 1/2 (preflight): requeueing (no node to blame)" in job.events()
    assert job.scontrol() == ["requeue 41"]


def test_a_failed_all_reduce_in_the_training_step_is_retried_without_blame(tmp_path):
    """slipway's trainer runs the all-reduce first in the training step (AllReduceGate): a rank that
    fails it writes why among the step's exit reports and exits before training."""
    job = Job(tmp_path)
    job.script("train.sh", f'[ "${PREFLIGHT_ENV}" = "4 300" ] || exit 9\n'
                           f'echo "rank 2 on node2: RuntimeError: timed out" > "$SLIPWAY_EXITS/{PREFLIGHT_FAILED_FILE}"'
                           "\nexit 5")
    assert job.run() == 0, job.out
    events = job.events()
    assert "preflight failed: rank 2 on node2: RuntimeError: timed out" in events
    assert "retry 1/2 (preflight): requeueing (no node to blame)" in events
    assert job.scontrol() == ["requeue 41"]
    assert not (job.run_dir / ".exits" / "41").exists()  # the reports are read, then removed


def test_a_failed_all_reduce_step_of_a_train_script_is_retried_without_blame(tmp_path):
    job = Job(tmp_path, "train.script=train_mine.py")
    job.script("allreduce.sh", 'echo "slipway-preflight-allreduce fail: rank 2 on node2: RuntimeError: timed out"'
                               "\nexit 5")
    job.script("train.sh", 'echo TRAINING > "$FAKE/trained"')
    assert job.run() == 0, job.out
    events = job.events()
    assert "preflight failed: rank 2 on node2: RuntimeError: timed out" in events
    assert "retry 1/2 (preflight): requeueing (no node to blame)" in events
    assert not (job.fake / "trained").exists()


def test_a_training_step_that_fails_after_a_passed_all_reduce_is_not_a_preflight_failure(tmp_path):
    job = Job(tmp_path, "slurm.requeue=false")
    job.script("train.sh", "exit 1")
    assert job.run() == 1, job.out
    assert not [e for e in job.events() if e.startswith(("preflight failed", "retry", "not retrying"))]


def test_a_passed_preflight_trains_with_the_all_reduce_in_the_training_step(tmp_path):
    job = Job(tmp_path)
    job.script("train.sh", f'echo "${PREFLIGHT_ENV}" > "$FAKE/trained"')
    job.script("allreduce.sh", "exit 99")  # no step of its own
    assert job.run() == 0, job.out
    assert (job.fake / "trained").read_text() == "4 300\n"  # MiB, slurm.preflight_timeout
    assert "trainer.preflight allreduce" not in job.text and "PREFLIGHT_PORT" not in job.text
    assert (job.run_dir / "logs" / "preflight-41.out").read_text().count("slipway-preflight node") == 2


def test_a_passed_all_reduce_step_of_a_train_script_records_the_bandwidth_and_trains(tmp_path):
    job = Job(tmp_path, "train.script=train_mine.py")
    job.script("train.sh", 'echo "TRAINING ${%s:-}" > "$FAKE/trained"' % PREFLIGHT_ENV)
    assert job.run() == 0, job.out
    assert ("preflight ok on node[1-2]: all-reduce of 4 MiB over 4 ranks on 2 node(s) (gloo): 1.00 GB/s"
            in job.events())
    assert (job.fake / "trained").read_text() == "TRAINING \n"  # the user's script is not asked for it


def test_a_hang_names_the_silent_node_and_retries_without_it(tmp_path):
    job = Job(tmp_path)
    job.script("train.sh", job.hang_dumps("41r2", {"node1": [0, 1], "node2": [3]}))
    assert job.run(restart=2) == 0, job.out
    events = job.events()
    assert ("hang: no step completed for 20 s after step 7; stack dumps from 3 of 4 ranks in hangs/41r2-*.txt; "
            "not answering in time: 1 of the 2 ranks on node2") in events
    assert "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)" in events


def test_a_late_dump_counts_as_no_answer(tmp_path):
    job = Job(tmp_path)
    job.script("train.sh", job.hang_dumps("41", {"node1": [0, 1], "node2": [2, 3]}, late=(3,)))
    assert job.run() == 0, job.out
    events = job.events()
    assert any("from 4 of 4 ranks" in e and e.endswith("not answering in time: 1 of the 2 ranks on node2") for e in events)
    assert "retry 1/2 (hang): requeueing without node2 (excluded nodes: node2)" in events


def test_a_hang_without_spare_nodes_ends_with_exit_4(tmp_path):
    job = Job(tmp_path, partition="node1 alloc\nnode2 alloc")
    job.script("train.sh", job.hang_dumps("41", {"node1": [0, 1], "node2": [2]}))
    assert job.run() == HANG_EXIT, job.out
    assert ("not retrying (hang): without node2 partition debug has 1 usable node(s), the job needs 2"
            in job.events())
    assert job.events()[-1] == f"end exit {HANG_EXIT}"


def test_old_dumps_of_an_earlier_attempt_do_not_count(tmp_path):
    job = Job(tmp_path)
    (job.run_dir / "hangs").mkdir()
    (job.run_dir / "hangs" / "41-node1-0.txt").write_text(HangLine(0, "node1", 3, 1.0, 1.0, on_time=True).line() + "\n")
    job.script("train.sh", "exit 0")
    assert job.run(restart=1) == 0, job.out  # this attempt is 41r1: it did not hang
    assert not any(e.startswith("hang:") for e in job.events())


def test_a_hang_where_every_rank_dumped_blames_no_node(tmp_path):
    job = Job(tmp_path)
    job.script("train.sh", job.hang_dumps("41", {"node1": [0, 1], "node2": [2, 3]}))
    assert job.run() == 0, job.out
    events = job.events()
    assert any(e.startswith("hang: ") and "from 4 of 4 ranks" in e and "no dump" not in e for e in events), events
    assert "retry 1/2 (hang): requeueing (no node to blame)" in events


def test_a_dead_node_is_retried_without(tmp_path):
    # node2 is in two partitions: sinfo -N lists it twice
    job = Job(tmp_path, partition="node1 alloc\nnode2 down*\nnode2 down*\nnode3 idle")
    job.script("train.sh", "exit 1")
    assert job.run() == 0, job.out
    events = job.events()
    assert "node failure: node2 not responding, down or drained after the step failed (exit 1)" in events
    # one sinfo for the job's nodes, not one per node (1000-node jobs)
    asked = [line for line in (job.fake / "sinfo.log").read_text().splitlines() if " -n " in f" {line} "]
    assert asked == ["-h -N -n node[1-2] -o %N %t"], asked
    assert "retry 1/2 (node failure): requeueing without node2 (excluded nodes: node2)" in events


def test_a_plain_failure_is_not_retried(tmp_path):
    job = Job(tmp_path)
    job.script("train.sh", "exit 1")
    assert job.run() == 1, job.out
    assert not any("retry" in e for e in job.events()) and job.scontrol() == []


def test_time_limit_requeues_are_counted_apart(tmp_path):
    job = Job(tmp_path, "slurm.max_requeues=1")
    (job.run_dir / "events.log").write_text(
        "2026-01-01T00:00:00+00:00 job 41 retry 1/2 (hang): requeueing (no node to blame)\n")
    job.script("train.sh", "exit 75")
    assert job.run(restart=1) == 0, job.out  # a failure retry does not use up the time-limit requeue
    assert "time-limit requeue 1/1: saved after the stop request, requeueing" in job.events()
    assert job.run(restart=2) == 75, job.out
    assert ("not requeueing after the time-limit warning: slurm.max_requeues (1) reached; saved after the stop "
            "request") in job.events()


def test_requeue_off_never_retries(tmp_path):
    job = Job(tmp_path, "slurm.requeue=false")
    job.script("node.sh", 'echo "slipway-preflight node1 ok: fine"\necho "slipway-preflight node2 fail: bad"')
    assert job.run() == PREFLIGHT_EXIT, job.out
    assert "not retrying (preflight): slurm.requeue is off" in job.events()


@pytest.mark.parametrize("overrides", [["slurm.preflight=false"],
                                       ["launch.launcher=srun", "launch.command=[/bin/true]"]])
def test_no_preflight_when_off_or_with_a_custom_command(tmp_path, overrides):
    job = Job(tmp_path, *overrides)
    assert "trainer.preflight" not in job.text and "PREFLIGHT_PORT" not in job.text and PREFLIGHT_ENV not in job.text
    job.script("node.sh", "exit 99")
    assert job.run() == 0, job.out


# ---------------------------------------------------------------- what the job runs, checked first


def _code(tmp_path: Path):
    from jobs.runs.code import plan_snapshot

    return plan_snapshot(tmp_path / "p" / "runs" / ".code", None).write()


def test_code_changed_after_submission_ends_the_job_before_anything_runs(tmp_path):
    code = _code(tmp_path)
    job = Job(tmp_path, pins=Pins(code=code))
    job.script("train.sh", "echo TRAINING >> \"$FAKE/trained\"")
    assert job.run() == 0, job.out  # as submitted: it trains
    assert (job.fake / "trained").exists()
    (job.fake / "trained").unlink()
    edited = Path(code.dir) / "trainer" / "optim.py"
    edited.chmod(0o644)
    edited.write_text(edited.read_text() + "\n# edited in the store after submission\n")
    (job.run_dir / "events.log").unlink()
    assert job.run() == 2, job.out
    events = job.events()
    assert events == [events[0], f"verification failed: {edited} differs from the file submitted (on node1)",
                      "end exit 2"], events
    assert not (job.fake / "trained").exists() and not (job.fake / "scontrol.log").read_text().count("requeue")


def test_an_image_removed_before_the_start_is_one_line_and_no_retry(tmp_path):
    image = tmp_path / "images" / "slipway-0123.sqsh"
    image.parent.mkdir()
    image.write_bytes(b"hsqs" * 100)
    st = image.stat()
    pins = Pins(image_file=str(image), image_size=st.st_size, image_mtime=int(st.st_mtime), image_identity="b" * 64)
    job = Job(tmp_path, pins=pins)
    image.unlink()
    assert job.run() == 2, job.out
    assert job.events()[1:] == [f"verification failed: the image {image} is not there (removed or moved after "
                                "submission, or this node does not see its filesystem): restore it, or build the image "
                                "again and submit again (on node1)",
                                "end exit 2"]
    assert "requeue" not in (job.fake / "scontrol.log").read_text()


def test_a_changed_job_library_is_refused_before_it_is_sourced(tmp_path):
    job = Job(tmp_path)
    lib = next((job.run_dir / "lib").glob("job_lib-*.sh"))
    lib.write_text(lib.read_text() + "\nrm -rf \"$HOME\"  # a change made after submission\n")
    assert job.run() == 2, job.out
    assert job.events() == [f"verification failed: {lib} is not the job library submitted (missing or changed): "
                            "submit again", "end exit 2"]
    lib.unlink()
    (job.run_dir / "events.log").unlink()
    assert job.run() == 2 and "is not the job library submitted" in job.events()[0]
