"""The training loops of FlowGRPO's ``scripts/train_sd3.py`` and DanceGRPO's
``fastvideo/train_grpo_flux.py``, rebuilt on tiny random-init diffusers models, with LeanGRPO
added the way a user adds it.

Both functions follow what the scripts do step by step (what is sampled, in which batches and
order, from which random draws; how advantages, the shuffle, the re-batching, the loss, the
accumulation, clipping and the optimizer run), reading the repositories at
``zhtmike/flow_grpo@9745241`` and ``XueZeyue/DanceGRPO@15cc71d``. What they leave out (text
encoders, the VAE and the image rewards, logging, evaluation, checkpoints, EMA copies,
distributed wrappers) does not touch the trained parameters' gradients; see each function.

Each loop comes in two parts: ``prepare_*`` holds the script's model lines (LoRA for FlowGRPO,
the device) and, where a user adds ``torch.compile``, the one line ``compile`` picks:

- ``"eager"``: the script as it is;
- ``"torch"``: ``pipeline.transformer = torch.compile(pipeline.transformer, backend=...)``;
- ``"lean"``: ``pipeline.transformer = leancompile.lean_compile(pipeline.transformer,
  backend=..., schedule=...)``;

the ``*_train_*`` function is the rest of the script (optimizer, seeds, sampling, advantages,
training), where LeanGRPO adds ``with transformer.rollout(train=..., trajectory_steps=T):``
around the sampling loop and ``with transformer.update():`` around the training loop (the
``phase`` lines: no-ops for the other two). A prepared model can run the loop again after
``load_trainable_state`` put its initial weights back (what a benchmark's repeats and the
tests' shared compiled wrappers do): ``schedule=`` then picks the rollout's schedule
(``rollout(schedule=...)``), so one compiled wrapper serves every schedule.

The result carries the gradients each optimizer step applied (after clipping, read just before
``optimizer.step()``), the trainable parameters after the run, the rollout's log-probs, each
update call's PPO statistics and, wrapped, the wrapper's ``stats``: what
``tests/test_real_loops.py`` compares.
"""

from .common import LoopRun, load_trainable_state, trainable_state, unwrapped
from .dance_grpo_flux import (DanceGRPOConfig, dance_grpo_train_flux, flux_prompt_bank,
                              prepare_dance_grpo, tiny_flux_transformer)
from .flow_grpo_sd3 import (SD3_LORA_TARGETS, FlowGRPOConfig, flow_grpo_train_sd3,
                            latent_reward, prepare_flow_grpo, sd3_prompt_bank,
                            tiny_sd3_pipeline)

__all__ = ["FlowGRPOConfig", "DanceGRPOConfig", "LoopRun", "SD3_LORA_TARGETS",
           "tiny_sd3_pipeline", "sd3_prompt_bank", "prepare_flow_grpo", "flow_grpo_train_sd3",
           "tiny_flux_transformer", "flux_prompt_bank", "prepare_dance_grpo",
           "dance_grpo_train_flux", "latent_reward", "unwrapped", "trainable_state",
           "load_trainable_state"]
