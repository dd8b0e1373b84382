"""Checkpoint/resume of the GRPO trainer (kill-and-resume reproduces the next step bitwise, a
crash during save keeps the previous checkpoint) and the data-parallel fault paths (a peer
that dies or hangs ends the others with a clear error within the timeout)."""

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from leancompile.grpo.trainer import GRPOConfig, GRPOTrainer
from models import ToyFlowPolicy
from ranks import spawn

CONFIG = GRPOConfig(group_size=2, schedule="retain", beta=0.05, timestep_fraction=0.75)


def reward(latents, conditions):
    return latents.float().flatten(1).mean(1)


def make(seed=0, config=CONFIG):
    policy = ToyFlowPolicy(seed=seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    return policy, optimizer


def conditions():
    return ToyFlowPolicy().example_conditions(2, generator=torch.Generator().manual_seed(1))


def params(policy):
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


def run(trainer, steps):
    # generator=None: the step draws its seed from torch's global generator, which the
    # checkpoint saves and restores.
    for _ in range(steps):
        trainer.step(conditions())


def uninterrupted(steps):
    torch.manual_seed(123)
    policy, optimizer = make()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG)
    run(trainer, steps)
    return params(policy)


def test_resume_reproduces_the_next_step_bitwise(tmp_path):
    expected = uninterrupted(3)
    torch.manual_seed(123)
    policy, optimizer = make()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG)
    run(trainer, 2)
    folder = trainer.save(tmp_path)
    assert folder.name == "step_00000002" and (tmp_path / "latest").read_text() == folder.name
    assert {p.name for p in folder.iterdir()} >= {"trainable.safetensors", "optimizer.pt",
                                                  "rng.pt", "trainer.json",
                                                  "reference.safetensors"}
    # Another process would start from other weights and random states.
    torch.manual_seed(999)
    policy, optimizer = make(seed=7)
    resumed = GRPOTrainer.load(tmp_path, policy, reward, optimizer)
    assert resumed.step_count == 2 and resumed.config == CONFIG
    run(resumed, 1)
    assert resumed.step_count == 3
    got = params(policy)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    torch.manual_seed(123)
    policy, optimizer = make()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG)
    run(trainer, 1)
    trainer.save(tmp_path)
    saved = params(policy)
    run(trainer, 1)
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        if str(f).endswith("rng.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        trainer.save(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())  # the partial one, ignored
    policy2, optimizer2 = make(seed=5)
    resumed = GRPOTrainer.load(tmp_path, policy2, reward, optimizer2)
    assert resumed.step_count == 1
    for name, value in params(policy2).items():
        assert torch.equal(value, saved[name]), name


def test_load_refuses_another_policy(tmp_path):
    policy, optimizer = make()
    GRPOTrainer(policy, reward, optimizer, CONFIG).save(tmp_path)
    other = ToyFlowPolicy(dim=4)
    with pytest.raises(ValueError, match="other trainable parameters"):
        GRPOTrainer.load(tmp_path, other, reward, torch.optim.Adam(other.parameters()))
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        GRPOTrainer.load(tmp_path / "nothing", policy, reward, optimizer)


_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_grpo_checkpoint import CONFIG, conditions, make, reward
    from leancompile.grpo.trainer import GRPOTrainer
    torch.manual_seed(123)
    policy, optimizer = make()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG)
    for k in range(1, 100):
        trainer.step(conditions())
        trainer.save({run_dir!r})
        print("saved", k, flush=True)
""")


def test_killed_run_resumes_to_the_uninterrupted_next_step(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent), run_dir=str(run_dir)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "saved 2":
                break
        os.kill(proc.pid, signal.SIGKILL)  # somewhere in step 3 or its save
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    policy, optimizer = make(seed=3)
    resumed = GRPOTrainer.load(run_dir, policy, reward, optimizer)
    k = resumed.step_count
    assert k >= 2
    run(resumed, 1)
    expected = uninterrupted(k + 1)
    for name, value in params(policy).items():
        assert torch.equal(value, expected[name]), (k, name)


def _fault_worker(rank, world, init, out, mode):
    parallel, mode = ("fsdp", mode[5:]) if mode.startswith("fsdp-") else ("ddp", mode)
    # fsdp: the collectives inside the compiled graphs wait for the process group's timeout
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=6 if parallel == "fsdp"
                                                       else 1800))
    from leancompile.grpo.parallel import PeerFailureError

    policy, optimizer = make()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG, parallel=parallel, timeout_s=3)

    def fail():
        if mode == "die":
            os._exit(3)
        time.sleep(12)  # hangs (past both timeouts)
        os._exit(0)

    if rank == 1 and parallel == "ddp":
        fail()
    if parallel == "fsdp":  # one step first (compiled), then fail inside the step's gathers
        trainer.step(conditions())
        if rank == 1:
            setup = trainer._setup
            trainer._setup = lambda *a, **k: (setup(*a, **k), fail())
    start = time.perf_counter()
    try:
        trainer.step(conditions())
        result = {"error": None}
    except PeerFailureError as e:
        result = {"error": str(e)}
    result["seconds"] = time.perf_counter() - start
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.parametrize("mode", ["die", "hang", "fsdp-die", "fsdp-hang"])
def test_a_dead_or_hung_peer_ends_the_others_with_a_clear_error(tmp_path, mode):
    ctx = spawn(_fault_worker, args=(2, str(tmp_path / "init"), str(tmp_path), mode),
                nprocs=2, join=False)
    for p in ctx.processes:
        p.join(120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None and "a peer rank died, hangs" in result["error"]
    assert "resume from the last checkpoint" in result["error"]
    assert result["seconds"] < 15, result  # timeout_s=3 (a dead peer: at once)


def test_lora_checkpoint_has_peft_adapters_and_resumes(tmp_path):
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        policy = ToyFlowPolicy()
        policy.net = get_peft_model(policy.net, LoraConfig(r=2, target_modules=["0", "2"],
                                                           init_lora_weights=False))
        return policy, torch.optim.Adam([p for p in policy.parameters() if p.requires_grad],
                                        lr=1e-2)

    policy, optimizer = build()
    trainer = GRPOTrainer(policy, reward, optimizer, CONFIG)
    trainer.step(conditions(), torch.Generator().manual_seed(3))
    folder = trainer.save(tmp_path)
    assert (folder / "adapter" / "adapter_config.json").is_file()  # peft's own format
    trainer.step(conditions(), torch.Generator().manual_seed(4))
    expected = params(policy)
    policy2, optimizer2 = build()
    GRPOTrainer.load(tmp_path, policy2, reward, optimizer2).step(
        conditions(), torch.Generator().manual_seed(4))
    for name, value in params(policy2).items():
        assert torch.equal(value, expected[name]), name
