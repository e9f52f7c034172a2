"""Private Ray/RLlib names the project hooks, pinned: an upgrade that renames or re-signs one
fails here, loudly, instead of silently changing behaviour (each test names the user). The
workarounds of Ray Tune's, Ray's and W&B's internals are all in agents/workarounds.py and
agents/experiment_store.py."""
import inspect
import re

import numpy as np
import pytest
import torch

from ray import tune
from ray.rllib.algorithms.dqn import DQN
from ray.rllib.core.learner.learner import Learner
from ray.rllib.env.env_runner import EnvRunner


def params(fn) -> list[str]:
    # Ray's tracing adds a `_ray_trace_ctx` keyword to a class's methods in place once any
    # test has turned the class into an actor; that is Ray's own, not part of the hook.
    return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]


def test_env_runner_reset_hook_used_by_the_stock_token_env_runner():
    # agents/env_runner.py StockTokenEnvRunner._try_env_reset shifts the seed per sample() call
    assert params(EnvRunner._try_env_reset) == ["self", "seed", "options"]
    src = inspect.getsource(__import__("ray.rllib.env.single_agent_env_runner", fromlist=["x"]))
    assert "self._try_env_reset(" in src


def test_learner_minibatch_iterator_hook_used_by_sequence_minibatching():
    # agents/algorithms/ppo.py LMPPOTorchLearner._create_iterator_if_necessary
    names = params(Learner._create_iterator_if_necessary)
    for name in ("training_data", "num_epochs", "minibatch_size", "shuffle_batch_per_epoch",
                 "num_total_minibatches"):
        assert name in names, names
    assert "_create_iterator_if_necessary(" in inspect.getsource(Learner.update)


def test_dqn_replay_buffer_hook_used_by_whole_episode_replay():
    # agents/algorithms/dqn.py LMDQN._create_local_replay_buffer_if_necessary
    assert params(DQN._create_local_replay_buffer_if_necessary) == ["self", "config"]


def test_tuner_local_tuner_used_on_resume():
    # agents/workarounds.py replace_restored_callbacks sets the restored run config's callbacks through
    # tuner._local_tuner
    assert "self._local_tuner" in inspect.getsource(tune.Tuner.__init__)
    assert hasattr(__import__("ray.tune.impl.tuner_internal", fromlist=["x"]).TunerInternal, "get_run_config")


def test_gae_standardizes_advantages_with_the_floor_the_default_keeps():
    # agents/algorithms/advantages.py: at RLLIB_STD_FLOOR (training.advantage_std_floor's default)
    # the pipeline is RLlib's own, whose GAE divides by max(1e-4, std), a literal in its code
    from ray.rllib.connectors.learner import GeneralAdvantageEstimation

    from agents.algorithms.advantages import RLLIB_STD_FLOOR

    source = inspect.getsource(GeneralAdvantageEstimation.__call__)
    assert RLLIB_STD_FLOOR == 1e-4 and re.search(r"/ max\(\s*1e-4,\s*module_advantages\.std\(\)", source)


def test_learner_connector_pipeline_hook_used_by_the_lm_learners():
    # agents/algorithms/{token_learner,guided,reinforce}.py insert their connector pieces around GAE in
    # Learner._learner_connector, as RLlib's own PPOLearner and DQNLearner do: no public accessor
    # exists, and GAE (which the guided and sequence-level learners replace) is only added there.
    from ray.rllib.algorithms.ppo.ppo_learner import PPOLearner

    assert "self._learner_connector = self.config.build_learner_connector(" in inspect.getsource(Learner.build)
    assert "self._learner_connector.append(" in inspect.getsource(PPOLearner.build)
    # agents/algorithms/sequence_batching.py AddOneTsToUnfinishedEpisodes replaces the bootstrap
    # piece PPOLearner prepends, and sets the shared-data flag RLlib's piece sets for the time-dim
    # piece (a private key).
    assert "self._learner_connector.prepend(AddOneTsToEpisodesAndTruncate())" in inspect.getsource(PPOLearner.build)
    from ray.rllib.connectors.common.add_time_dim_to_batch_and_zero_pad import AddTimeDimToBatchAndZeroPad
    from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate

    for piece in (AddOneTsToEpisodesAndTruncate, AddTimeDimToBatchAndZeroPad):
        assert '"_added_loss_mask_for_valid_episode_ts"' in inspect.getsource(piece.__call__), piece
    # ... and the whole-sequence minibatching reads the batch the way Learner.update builds it.
    assert params(Learner._make_batch_if_necessary) == ["self", "training_data"]


def test_torch_module_hook_dicts_read_by_the_gpt2_tensor_op_step():
    # agents/modules/kv_cache.py gpt2_step refuses a trunk with forward hooks (the tensor-op step
    # would skip them); torch has no public way to ask whether a module has hooks.
    module = torch.nn.Linear(2, 2)
    assert not module._forward_hooks and not module._forward_pre_hooks
    module.register_forward_hook(lambda *a: None)
    module.register_forward_pre_hook(lambda *a: None)
    assert len(module._forward_hooks) == 1 and len(module._forward_pre_hooks) == 1


def test_tune_logger_hooks_used_by_the_continuous_curves_loggers():
    # agents/workarounds.py make_curve_logger, make_progress_csv_logger: a resumed trial's repeated
    # iterations are dropped from TensorBoard and progress.csv
    from ray.tune.logger import CSVLoggerCallback, TBXLoggerCallback

    tbx = inspect.getsource(TBXLoggerCallback)
    for name in ("self._trial_writer", "self._trial_result", "self._summary_writer_cls"):
        assert name in tbx, name
    assert "self._trial_files" in inspect.getsource(CSVLoggerCallback)
    assert params(CSVLoggerCallback._setup_trial) == ["self", "trial"]


def test_wandb_logger_hooks_used_by_the_resuming_wandb_logger():
    # agents/workarounds.py ResumingWandbLogger: Ray's W&B logging actor with its `wandb` module wrapped
    # so a resumed trial's repeated iterations are not logged twice; no public hook exists.
    from ray.air.integrations.wandb import WandbLoggerCallback, _WandbLoggingActor

    assert "self._wandb" in inspect.getsource(_WandbLoggingActor)
    assert params(_WandbLoggingActor.__init__)[:2] == ["self", "logdir"]
    assert "self._logger_actor_cls" in inspect.getsource(WandbLoggerCallback)


def test_sync_weights_and_fused_copy_used_by_the_colocated_weight_sync():
    # agents/weight_sync.py install_colocated_sync wraps an EnvRunnerGroup's sync_weights (same
    # keywords; the algorithms call it with from_worker_or_learner_group=their learner group) and
    # copies the tensors with torch._foreach_copy_ (one fused copy, casting to the destination's dtype).
    from ray.rllib.algorithms.ppo import PPO
    from ray.rllib.env.env_runner_group import EnvRunnerGroup

    assert params(EnvRunnerGroup.sync_weights) == ["self", "policies", "from_worker_or_learner_group",
                                                   "to_worker_indices", "global_vars", "timeout_seconds",
                                                   "inference_only"]
    assert "from_worker_or_learner_group=self.learner_group" in inspect.getsource(PPO.training_step)
    dst, src = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    torch._foreach_copy_(dst, src)
    assert dst[0].dtype == torch.bfloat16 and dst[0].tolist() == [1.0] * 3 and dst[1].tolist() == [2.0] * 2


def test_weights_seq_no_set_by_the_colocated_weight_sync():
    # agents/weight_sync.py sync_colocated sets the EnvRunner's private _weights_seq_no (RLlib's
    # EnvRunner.set_state sets it from the state's WEIGHTS_SEQ_NO, and get_state and sample() report
    # it) to the learner's, read from Learner.get_state(components=[]) (no module state built).
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    for method in (SingleAgentEnvRunner.__init__, SingleAgentEnvRunner.set_state, SingleAgentEnvRunner.get_state):
        assert "self._weights_seq_no" in inspect.getsource(method)
    assert "WEIGHTS_SEQ_NO: self._weights_seq_no" in inspect.getsource(Learner.get_state)


def test_clip_function_and_apply_gradients_hooks_used_by_the_fused_gradients():
    # agents/algorithms/gradients.py FusedGradients overrides TorchLearner._get_clip_function
    # (RLlib's postprocess_gradients_for_module clips through it) and apply_gradients, whose fast
    # path sets self._params[pid].grad and steps the optimizers only where RLlib's would do no more
    # (no self._grad_scalers, no self._lr_scheduler_classes); the clip fuses its per-tensor ops
    # with torch._foreach_norm and torch._foreach_mul_ (a 0-d tensor factor).
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    assert "self._get_clip_function()(" in inspect.getsource(Learner.postprocess_gradients_for_module)
    assert params(TorchLearner._get_clip_function) == []
    apply = inspect.getsource(TorchLearner.apply_gradients)
    for name in ("self._params[pid].grad", "self._lr_scheduler_classes", "self._grad_scalers",
                 "self.config.torch_skip_nan_gradients", "optim.step()"):
        assert name in apply, name
    # The fast path restates what RLlib's method does with finite gradients: any change to it (a
    # metric, a hook) must be looked at, so its source is pinned whole.
    import hashlib

    assert hashlib.sha256(apply.encode()).hexdigest()[:16] == "5613837a71ab844f", (
        "RLlib's TorchLearner.apply_gradients changed: re-check FusedGradients.apply_gradients "
        "(agents/algorithms/gradients.py) against it, then update this hash")
    init = inspect.getsource(TorchLearner.__init__) + inspect.getsource(Learner.__init__)
    assert "self._lr_scheduler_classes" in init and "self._params" in init
    grads = [torch.full((2,), 3.0), torch.full((3,), float("inf"))]
    assert [n.item() for n in torch._foreach_norm(grads, 2.0)] == [torch.full((2,), 3.0).norm().item(), float("inf")]
    torch._foreach_mul_(grads, torch.tensor(0.5))
    assert grads[0].tolist() == [1.5, 1.5]


def test_foreach_ops_and_adam_state_used_by_the_update_clipping():
    # agents/algorithms/gradients.py UpdateClipping hooks torch's Adam step (register_step_pre_hook /
    # register_step_post_hook), reads its state's "step" and "exp_avg_sq" after the step, and
    # computes with torch._foreach_div (by a 0-d tensor), _foreach_clamp_min_, _foreach_sqrt_ and
    # _foreach_lerp_ (a list of 0-d tensor weights).
    p = torch.nn.Parameter(torch.zeros(3))
    for kind in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        optimizer = torch.optim.Adam([p], lr=0.1, **kind)
        seen = []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
        p.grad = torch.full((3,), 2.0)
        optimizer.step()
        assert seen == ["pre", "post"], kind
        state = optimizer.state[p]
        assert float(state["step"]) == 1.0 and torch.allclose(state["exp_avg_sq"], torch.full((3,), 0.004)), kind
    x = torch._foreach_div([torch.full((2,), 4.0)], torch.tensor(2.0))
    torch._foreach_clamp_min_(x, 3.0)
    torch._foreach_sqrt_(x)
    assert x[0].tolist() == pytest.approx([3.0 ** 0.5] * 2)
    a, b = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.ones(3)]
    torch._foreach_lerp_(a, b, [torch.tensor(0.25), torch.tensor(0.0)])
    assert a[0].tolist() == [0.25, 0.25] and a[1].tolist() == [0.0] * 3


# Every private Ray/RLlib/Tune/Gymnasium/transformers name the project overrides or reads, each
# pinned by a test above. RLlib's documented extension points (methods it marks
# @OverrideToImplementCustomLogic, e.g. RLModule._forward_train) are not private in that sense.
PINNED = {
    "_try_env_reset", "_create_iterator_if_necessary", "_make_batch_if_necessary", "_learner_connector",
    "_create_local_replay_buffer_if_necessary", "_local_tuner", "_trial_writer", "_trial_result",
    "_summary_writer_cls", "_trial_files", "_setup_trial", "_WandbLoggingActor", "_wandb", "_logger_actor_cls",
    "_grad_scalers", "_module_optimizers", "_logged",
    "_schedule_tracked_actor_task", "_tracked_actor", "_actor_task_events", "_tracked_futures",
    "_tracked_actors_to_task_futures", "_forward_hooks", "_forward_pre_hooks", "_foreach_copy_",
    "_FilesystemSyncer", "_sync_up_command", "_delete_fs_path", "_get_clip_function", "_lr_scheduler_classes", "_params",
    "_foreach_norm", "_foreach_mul_", "_foreach_div", "_foreach_clamp_min_", "_foreach_sqrt_", "_foreach_lerp_",
    "_update", "_compute_off_policyness", "_worker_logs_enabled",
    "_scheduler_alg", "_storage", "_brackets", "_rungs", "_trial_info", "_trial_state", "_num_perturbations",
    "_num_checkpoints", "_checkpoint_results", "_restore_trials", "_setup_signal_catching",
    "_latest_checkpoint_result",
}
THIRD_PARTY_PRIVATE_OK = {"_model"}  # bert_score's scorer (env/rewards/bertscore.py), not Ray's or transformers'


def _project_files():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    return [p for d in ("agents", "env") for p in sorted((root / d).rglob("*.py"))]


def test_no_unpinned_private_attribute_of_a_library_is_read():
    """Static: every `x._name` in agents/ and env/ is either the project's own name (defined
    somewhere in agents/ or env/) or pinned above."""
    import ast

    defined, used, imported_private = set(), {}, set()
    for path in _project_files():
        tree = ast.parse(path.read_text())
        # names bound to a library's class or module here: a private name assigned on one
        # (`TuneController._x = ...`, a hook) is the library's, not the project's own
        library = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   and ((getattr(node, "module", None) or node.names[0].name).split(".")[0] not in ("agents", "env"))
                   and not getattr(node, "level", 0) for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute):
                if (isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id in library
                        and node.attr.startswith("_") and not node.attr.startswith("__")):
                    used.setdefault(node.attr, f"{path.name}:{node.lineno}")
                    imported_private.add(node.attr)
                elif isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif node.attr.startswith("_") and not node.attr.startswith("__"):
                    used.setdefault(node.attr, f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] not in ("agents", "env"):
                for alias in node.names:  # `from library import _private`
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        used.setdefault(alias.name, f"{path.name}:{node.lineno}")
                        imported_private.add(alias.name)
    # Names the project assigns on a library object it subclasses (e.g. a class attribute the
    # library reads) count as its own only where they are not a library's: those are pinned.
    foreign = {name: where for name, where in used.items()
               if (name not in defined or name in imported_private) and name not in PINNED | THIRD_PARTY_PRIVATE_OK}
    assert not foreign, f"private library names read without a pin in this file: {foreign}"


def test_no_unpinned_private_library_method_is_overridden():
    """Runtime: no class of agents/ or env/ overrides a private method of a library base class
    unless the library marks it as the place to override, or it is pinned above."""
    import importlib

    overridden = {}
    for path in _project_files():
        if path.name == "__main__.py":  # `python -m` entry points: importing one runs the command
            continue
        rel = path.relative_to(path.parents[1] if path.parent.name in ("agents", "env") else path.parents[2])
        module_name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module_name):
                continue
            for name in vars(cls):
                if not name.startswith("_") or name.startswith("__") or name == "_abc_impl":  # abc's bookkeeping
                    continue
                for base in cls.__mro__[1:]:
                    if base.__module__.split(".")[0] in ("agents", "env") or name not in vars(base):
                        continue
                    if getattr(vars(base)[name], "__is_overridden__", None) is False:
                        break  # an extension point (@OverrideToImplementCustomLogic)
                    if name not in PINNED:
                        overridden[f"{module_name}.{cls.__name__}.{name}"] = f"{base.__module__}.{base.__name__}"
                    break
    assert not overridden, f"private library methods overridden without a pin in this file: {overridden}"


def test_torch_learner_grad_scaler_hooks_used_by_fp16_training():
    # agents/config.py sets config.experimental(_torch_grad_scaler_class=LossScaler) for
    # training.precision fp16; agents/algorithms/ppo.py LMPPOTorchLearner.postprocess_gradients
    # unscales through self._grad_scalers / self._module_optimizers before clipping.
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    assert "_torch_grad_scaler_class" in params(AlgorithmConfig.experimental)
    init, update = inspect.getsource(TorchLearner.__init__), inspect.getsource(TorchLearner._uncompiled_update)
    assert "self._grad_scalers" in init and "_torch_grad_scaler_class" in init
    assert update.index("compute_gradients(") < update.index("postprocess_gradients(") < update.index(
        "apply_gradients(")
    assert "scaler.step(" in inspect.getsource(TorchLearner.apply_gradients)
    assert "self._module_optimizers" in inspect.getsource(Learner)


def test_torch_learner_update_replaced_by_the_static_update():
    # agents/algorithms/static_update.py StaticUpdate._update takes TorchLearner._update's place
    # (what Learner.update calls per minibatch; it returns (fwd_out, loss per module, metrics))
    # and first calls self._compute_off_policyness(batch), as RLlib's update does
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    assert "fwd_out, loss_per_module, _ = self._update(" in inspect.getsource(Learner.update)
    assert "_update" in vars(TorchLearner)
    update = inspect.getsource(TorchLearner._uncompiled_update)
    assert update.index("self._compute_off_policyness(batch)") < update.index("forward_train(")


def test_tune_encoder_log_once_keys_forgotten_by_the_driver():
    # agents/workarounds.py forget_encoded_values drops Tune's encoder keys from ray.util.debug._logged
    from ray.tune.utils import serialization
    from ray.util import debug

    from agents.workarounds import ENCODER_LOG_KEY

    assert isinstance(debug._logged, set)
    assert f'log_once(f"{ENCODER_LOG_KEY}{{str(obj)}}")' in inspect.getsource(serialization.TuneFunctionEncoder)


def test_tune_actor_manager_task_futures_released_by_the_driver():
    # agents/workarounds.py release_resolved_task_futures wraps RayActorManager._schedule_tracked_actor_task
    # and the (on_result, on_error) pair RayEventManager keeps per future
    from ray.air.execution._internal.actor_manager import RayActorManager
    from ray.air.execution._internal.event_manager import RayEventManager

    assert params(RayActorManager._schedule_tracked_actor_task.__dict__.get("original",
                                                                           RayActorManager._schedule_tracked_actor_task)) \
        == ["self", "tracked_actor_task", "method_name", "args", "kwargs", "_return_future"]
    src = inspect.getsource(RayActorManager)
    assert "self._tracked_actors_to_task_futures[tracked_actor].add(future)" in src
    assert "tracked_actor = tracked_actor_task._tracked_actor" in src
    assert "self._actor_task_events.track_future(" in src
    assert "self._tracked_futures[future] = (on_result, on_error)" in inspect.getsource(RayEventManager.track_future)
    assert "on_result, on_error = self._tracked_futures.pop(future)" in inspect.getsource(RayEventManager.resolve_future)


def test_tune_trial_decisions_dropped_from_a_restored_controller():
    # agents/workarounds.py drop_restored_trial_decisions wraps TuneController.__setstate__ (what a
    # resume restores the saved runner_data with) and empties the two decision dicts a failure
    # during a save leaves behind (a cached STOP, run after the trial's next save).
    from ray.tune.execution.tune_controller import TuneController

    from agents.workarounds import drop_restored_trial_decisions

    src = inspect.getsource(TuneController)
    assert "self.__setstate__(experiment_state[\"runner_data\"])" in src
    assert "self._cached_trial_decisions[trial.trial_id] = TrialScheduler.STOP" in src
    assert "decision = self._cached_trial_decisions.pop(trial.trial_id, None)" in src
    assert "self._queued_trial_decisions = {}" in inspect.getsource(TuneController.__init__)
    for name in ("_cached_trial_decisions", "_queued_trial_decisions"):  # saved with the state
        assert f'"{name}"' not in inspect.getsource(TuneController.__getstate__)
    drop_restored_trial_decisions()
    controller = TuneController.__new__(TuneController)
    controller._create_checkpoint_manager = lambda: None  # the rest of a restore, not under test
    controller.__setstate__({"_session_str": "s", "_start_time": 0.0, "_cached_trial_decisions": {"t1": "STOP"},
                             "_queued_trial_decisions": {"t1": "STOP"}})
    assert controller._cached_trial_decisions == {} and controller._queued_trial_decisions == {}
    assert controller._session_str == "s"


def test_tune_interrupt_event_kept_by_the_train_cli():
    # agents/workarounds.py note_tune_interrupts wraps ray.tune.tune._setup_signal_catching (called
    # by name in tune.run) to keep the event its SIGINT handler sets; tune_interrupted reads it.
    import ray.tune.tune as tune_run

    from agents.workarounds import note_tune_interrupts, tune_interrupted

    setup = tune_run._setup_signal_catching
    assert params(setup.__dict__.get("original", setup)) == []
    assert "experiment_interrupted_event = _setup_signal_catching()" in inspect.getsource(tune_run.run)
    assert "experiment_interrupted_event.set()" in inspect.getsource(setup.__dict__.get("original", setup))
    note_tune_interrupts()
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, getattr(signal, "SIGUSR1", signal.SIGINT))}
    event = tune_run._setup_signal_catching()
    try:
        assert not tune_interrupted()
        event.set()
        assert tune_interrupted()
    finally:
        event.clear()  # no later summary in this process reads it as interrupted
        for s, handler in handlers.items():  # as they were before Tune's handlers
            signal.signal(s, handler)


def test_stock_env_runner_sampling_state_saved_by_the_stock_token_env_runner():
    # agents/rollout_state.py sampling_state (StockTokenEnvRunner) saves where RLlib's runner stands
    # between sample() calls (episodes in progress, their chunks for metrics, the next module
    # input, the connectors' shared data) so a resumed DQN run samples on exactly.
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    init, sample = inspect.getsource(SingleAgentEnvRunner.__init__), inspect.getsource(SingleAgentEnvRunner._sample)
    for name in ("_cached_to_module", "_needs_initial_reset", "_ongoing_episodes", "_done_episodes_for_metrics",
                 "_ongoing_episodes_for_metrics"):
        assert f"self.{name}" in init, name
    for name in ("_cached_to_module", "_needs_initial_reset", "_ongoing_episodes", "_shared_data"):
        assert f"self.{name}" in sample, name


def test_dqn_learner_target_update_time_saved_by_the_lm_dqn_learner():
    # agents/algorithms/dqn.py LMDQNTorchLearner.get_state saves last_update_ts_by_mid (when each
    # target network was last synced), which RLlib's DQN learner keeps outside its state.
    from ray.rllib.algorithms.dqn.dqn_learner import DQNLearner

    assert "self.last_update_ts_by_mid[" in inspect.getsource(DQNLearner.after_gradient_based_update)


def test_serve_proxy_grpc_switch_used_by_the_policy_server():
    # agents/serve/cli.py sets RAY_SERVE_PROXY_USE_GRPC=1 for its private Ray instance: Serve's
    # proxy then calls the replicas over gRPC (a handle option `_by_reference=False`)
    import os
    import subprocess
    import sys

    from agents.serve.cli import SERVE_PROXY_GRPC
    from ray.serve._private import default_impl

    read = "from ray.serve._private.constants import RAY_SERVE_PROXY_USE_GRPC as v; print(v)"
    for value, expected in (("1", "True"), ("0", "False")):
        out = subprocess.run([sys.executable, "-c", read], env={**os.environ, SERVE_PROXY_GRPC: value},
                             capture_output=True, text=True, timeout=120).stdout.strip()
        assert out == expected, (value, out)
    assert "_by_reference=not RAY_SERVE_PROXY_USE_GRPC" in inspect.getsource(default_impl.get_proxy_handle)


def test_serve_direct_ingress_settings_used_by_the_policy_server():
    # agents/serve/cli.py --direct-port: the environment `direct_ingress_env` gives the private Ray
    # instance is what Serve's constants read (a port range whose end is exclusive, no minimum
    # drain), Serve still binds a replica's port without SO_REUSEADDR, and a freed port's default
    # quarantine outlasts TCP's TIME_WAIT (60 s; else a replacement's bind could fail and block it)
    import os
    import subprocess
    import sys

    from agents.serve.cli import direct_ingress_env
    from ray.serve._private import node_port_manager, replica

    env = direct_ingress_env(31234, 2)
    names = ["RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
             "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]
    assert sorted(env) == sorted(names)
    read = ("import ray.serve._private.constants as c; "
            f"print([getattr(c, n) for n in {names!r}] + [c.RAY_SERVE_PORT_QUARANTINE_S >= 65])")
    out = subprocess.run([sys.executable, "-c", read], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120).stdout.strip()
    assert out == "[True, 31234, 31236, 0.0, True]", out
    assert "list(range(min_port, max_port))" in inspect.getsource(node_port_manager.PortAllocator.__init__)
    assert "enable_so_reuseport=False" in inspect.getsource(replica.Replica._maybe_start_direct_ingress_servers)


def test_tune_storage_sync_up_command_replaced_and_checkpoint_deletion_deferred():
    # agents/experiment_store.py store_experiments_safely: Tune's background copy of the experiment
    # to the storage path runs the (function, kwargs) that _sync_up_command returns; the checkpoint
    # retention deletes through checkpoint_manager's module-level _delete_fs_path(fs=, fs_path=)
    import pyarrow.fs
    import ray.train._internal.checkpoint_manager as checkpoint_manager
    from ray.train._internal.storage import _delete_fs_path, _FilesystemSyncer

    from agents.experiment_store import _copy_then_delete, store_experiments_safely, upload_whole_files

    original = getattr(_FilesystemSyncer._sync_up_command, "original", _FilesystemSyncer._sync_up_command)
    assert params(original) == ["self", "local_path", "uri", "exclude"]
    assert "_sync_up_command(" in inspect.getsource(__import__("ray.train._internal.syncer", fromlist=["x"]))
    register = inspect.getsource(checkpoint_manager._CheckpointManager.register_checkpoint)
    assert "_delete_fs_path(fs=checkpoint.filesystem, fs_path=checkpoint.path)" in register
    assert params(_delete_fs_path) == ["fs", "fs_path"]
    store_experiments_safely()
    assert checkpoint_manager._delete_fs_path.original is _delete_fs_path
    syncer = _FilesystemSyncer(storage_filesystem=pyarrow.fs.LocalFileSystem())
    fn, kwargs = syncer._sync_up_command("/staging/run", "/storage/run", exclude=["*.tmp"])
    assert fn is _copy_then_delete and kwargs["copy"] is upload_whole_files
    assert {k: v for k, v in kwargs["kwargs"].items() if k != "order"} == \
        {"local_path": "/staging/run", "fs_path": "/storage/run", "exclude": ["*.tmp"]}
    # each copy made gets a later place in the order (agents.experiment_store._place)
    _, later = syncer._sync_up_command("/staging/run", "/storage/run", exclude=["*.tmp"])
    assert later["kwargs"]["order"] > kwargs["kwargs"]["order"] > 0
    # agents/trial_checkpoints.py remove_unnamed_checkpoints reads each restored trial's _CheckpointManager._checkpoint_results
    # (the kept checkpoints, a list of _TrainingResult), its latest, and the trial's storage folder
    from ray.train._internal.storage import StorageContext
    from ray.tune.experiment import Trial

    assert "self._checkpoint_results: List[_TrainingResult] = []" in inspect.getsource(checkpoint_manager._CheckpointManager.__init__)
    # go_back_from_lost_checkpoints sets its latest (what Trial.checkpoint restores from)
    init = inspect.getsource(checkpoint_manager._CheckpointManager.__init__)
    assert "self._latest_checkpoint_result: Optional[_TrainingResult] = None" in init
    assert "return self._latest_checkpoint_result" in inspect.getsource(
        checkpoint_manager._CheckpointManager.latest_checkpoint_result.fget)
    assert isinstance(Trial.latest_checkpoint_result, property) and isinstance(StorageContext.trial_fs_path, property)
    assert "self.run_metadata.checkpoint_manager" in inspect.getsource(Trial.latest_checkpoint_result.fget)


def test_pbts_scheduled_save_is_a_future_with_a_resolve_that_does_not_wait():
    # agents/pbt.py KeepRunningPBT.save reads a scheduled save's `future` (ray.wait, timeout 0) and
    # `resolve(block=False)`: None for one that failed (Tune logs it), else (checkpoint, metrics)
    from ray.train._internal.session import _FutureTrainingResult
    from ray.tune.schedulers.pbt import PopulationBasedTraining

    assert "self.future = future" in inspect.getsource(_FutureTrainingResult.__init__)
    resolve = inspect.getsource(_FutureTrainingResult.resolve)
    assert "timeout = 1e-9" in resolve and "ray.get(self.future, timeout=timeout)" in resolve
    assert "_FutureTrainingResult" in inspect.getsource(PopulationBasedTraining._checkpoint_or_exploit)


def test_a_restored_algorithm_takes_its_iteration_from_its_checkpoint():
    # agents/pbt.py KeepRunningPBT.restore gives a clone restored with no metrics empty ones:
    # Trainable.restore reads the iteration from them, then the Algorithm's own state sets it
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.tune.trainable import Trainable

    assert "checkpoint_metrics.get(TRAINING_ITERATION, 0)" in inspect.getsource(Trainable.restore)
    assert "self._iteration = state[TRAINING_ITERATION]" in inspect.getsource(Algorithm.set_state)


def test_tune_controller_saves_and_resumes_where_the_scheduler_hooks_expect():
    # agents/experiment_store.py hook_experiment_saves wraps TuneController.save_to_dir(self) (the
    # experiment's, search algorithm's and callbacks' files into _storage.experiment_driver_staging_path)
    # and TuneController.resume(self, resume_config) (trials re-added, each through the scheduler's
    # on_trial_add); agents/pbt.py ResumableASHA saves ASHA's _brackets' _rungs and _trial_info.
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.schedulers import AsyncHyperBandScheduler

    from agents.experiment_store import hook_experiment_saves

    hook_experiment_saves()
    save = getattr(TuneController.save_to_dir, "original", TuneController.save_to_dir)
    resume = getattr(TuneController.resume, "original", TuneController.resume)
    assert params(save) == ["self"] and params(resume) == ["self", "resume_config"]
    assert "self._storage.experiment_driver_staging_path" in inspect.getsource(save)
    assert "_search_alg.save_to_dir(" in inspect.getsource(save) and "_callbacks.save_to_dir(" in inspect.getsource(save)
    assert "_requeue_restored_trials(" in inspect.getsource(resume)
    assert "self._scheduler_alg" in inspect.getsource(TuneController.__init__)
    scheduler = AsyncHyperBandScheduler(metric="m", mode="max", max_t=8, grace_period=1, reduction_factor=2)
    assert isinstance(scheduler._trial_info, dict)
    assert all(isinstance(r[1], dict) for b in scheduler._brackets for r in b._rungs)
    assert "recorded[trial.trial_id] = cur_rew" in inspect.getsource(type(scheduler._brackets[0]).on_result)
    # agents/pbt.py KeepRunningPBT saves PBT's _trial_state (Trial -> _PBTTrialState), _num_perturbations
    # and _num_checkpoints; on_trial_add makes each re-added trial's state anew
    from ray.tune.schedulers import PopulationBasedTraining
    from ray.tune.schedulers.pbt import _PBTTrialState

    pbt_source = inspect.getsource(PopulationBasedTraining)
    assert "self._trial_state[trial] = _PBTTrialState(trial)" in pbt_source
    assert "self._num_perturbations = 0" in pbt_source and "self._num_checkpoints = 0" in pbt_source
    state_init = inspect.getsource(_PBTTrialState.__init__)
    for name in ("last_score", "last_checkpoint", "last_perturbation_time", "last_train_time"):
        assert f"self.{name}" in state_init, name


def _episode_data(rng, T: int, L: int = 6):
    obs = {"input_ids": rng.integers(0, 9, (T + 1, L)), "attention_mask": rng.integers(0, 2, (T + 1, L))}
    infos = [{"prompt": "p"}] + [{} for _ in range(T - 1)] + [{"generation": "g", "num_generated": T}]
    extras = {"action_logp": rng.standard_normal(T).astype(np.float32),
              "vf_preds": rng.standard_normal(T).astype(np.float32)}
    return obs, infos, rng.integers(0, 9, T), rng.standard_normal(T), extras


def test_episodes_built_from_a_template_equal_rllibs_constructor():
    # agents/runner_episodes.py EpisodeBuilder.build copies a constructor-built template episode
    # (SingleAgentEpisode.__slots__, InfiniteLookbackBuffer's attributes) and sets the per-episode
    # fields: an RLlib release that adds or derives a field differently fails here.
    import gymnasium as gym

    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    from agents.runner_episodes import EpisodeBuilder

    space = gym.spaces.Dict({"input_ids": gym.spaces.Box(0, 9, (6,), np.int64),
                             "attention_mask": gym.spaces.Box(0, 1, (6,), np.int64)})
    builder = EpisodeBuilder(space, gym.spaces.Discrete(9), ("action_logp", "vf_preds"))
    rng = np.random.default_rng(0)
    for T in (1, 4, 9):
        data = _episode_data(rng, T)
        ref, got = builder.construct(*data), builder.build(*data)
        got.validate()
        assert len(got) == T and got.is_done and got.get_return() == ref.get_return()
        ref_state, got_state = ref.get_state(), got.get_state()
        assert ref_state.pop("id_") != got_state.pop("id_")
        assert set(ref_state) == set(got_state)
        for key in ref_state:
            assert_same(ref_state[key], got_state[key], key)
        for name in SingleAgentEpisode.__slots__:  # every field, the private ones too
            if name != "id_":
                assert_same(_fields_of(getattr(ref, name)), _fields_of(getattr(got, name)), name)
    again = builder.build(*data)
    again.custom_data["x"] = 1  # each episode's own custom data
    assert "x" not in got.custom_data and "x" not in builder.template.custom_data


def _fields_of(value):
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    if isinstance(value, InfiniteLookbackBuffer):
        return {k: v for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _fields_of(v) for k, v in value.items()}
    return value


def assert_same(a, b, where):
    import tree

    flat_a, flat_b = tree.flatten_with_path(a), tree.flatten_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b], where
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert type(x) is type(y) and np.array_equal(np.asarray(x, dtype=object), np.asarray(y, dtype=object)), \
            (where, path, x, y)


def test_episode_metrics_pushed_into_stats_equal_one_log_value_per_episode():
    # agents/runner_episodes.py EpisodeMetrics.flush logs a call's episodes by pushing into the
    # Stats objects MetricsLogger.log_value creates (found under MetricsLogger.stats).
    from types import SimpleNamespace

    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

    from agents.runner_episodes import EPISODE_KEYS, EpisodeMetrics

    rng = np.random.default_rng(1)
    calls = [[(int(rng.integers(1, 20)), float(rng.standard_normal()), float(rng.random())) for _ in range(n)]
             for n in (3, 0, 250, 7)]
    ref, got = MetricsLogger(root=False), MetricsLogger(root=False)  # an EnvRunner's
    config = SimpleNamespace(metrics_num_episodes_for_smoothing=100, num_env_runners=0)
    runner, gathered = SimpleNamespace(metrics=got, config=config), EpisodeMetrics()
    for episodes in calls:
        for episode in episodes:
            for key, reduce, index in EPISODE_KEYS:
                ref.log_value(key, episode[index], reduce=reduce, window=100)
            gathered.add(*episode)
        gathered.flush(runner)
        if episodes:
            assert ref.reduce(compile=True) == got.reduce(compile=True)


def test_rlmodule_config_deprecation_logger_quieted_by_load_policy(tmp_path):
    # agents/generate.py load_policy filters the DeprecationWarning RLlib logs (through the
    # `ray._common.deprecation` logger) when it builds an RLModule via `RLModuleConfig`
    import os
    import subprocess
    import sys

    import ray._common.deprecation as deprecation
    from ray.rllib.core.rl_module import rl_module

    assert deprecation.logger.name == "ray._common.deprecation"
    assert 'old="RLModule(config=[RLModuleConfig object])"' in inspect.getsource(rl_module)
    from agents.config import algorithm_config, load
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv
    from tests.conftest import QUICKSTART

    algo_config = algorithm_config(load(QUICKSTART, []))
    algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build().save_to_path(
        str(tmp_path / MODULE_SUBDIR))
    loaded = subprocess.run([sys.executable, "-c", f"from agents.generate import load_policy; load_policy({str(tmp_path)!r})"],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert loaded.returncode == 0 and loaded.stderr == "", loaded.stderr[-2000:]


def test_tune_strict_metric_check_wording_read_by_the_train_cli():
    # agents/progress.py metric_error words Tune's own check (a scheduler's metric missing from a
    # result) as a one-line tune.metric error, recognising it by this text and the result's keys
    from ray.tune.execution.tune_controller import TuneController

    src = inspect.getsource(TuneController._validate_result_metrics)
    assert "did not include the" in src and "specified metric(s)" in src and "Result: {}" in src


def test_new_api_stack_note_quieted_by_the_train_cli():
    # agents/train.py main drops RLlib's "You are running X on the new API stack!" note through a
    # filter on this logger and this fragment of its message
    from ray.rllib.algorithms import algorithm_config

    assert algorithm_config.logger.name == "ray.rllib.algorithms.algorithm_config"
    assert "on the new API stack! " in inspect.getsource(algorithm_config.AlgorithmConfig)


def test_worker_log_switch_turned_off_by_the_serve_cli_at_shutdown():
    # agents/serve/cli.py sets it to False before Serve shuts down, so the driver does not print
    # the raylet's report of the controller task that shutdown kills
    from ray._private import worker

    assert worker._worker_logs_enabled is True
    assert "if not _worker_logs_enabled:" in inspect.getsource(worker.print_worker_logs)


def test_checkpoint_component_names_spelled_out_by_the_saved_policy_lookup():
    # agents/saved_policy.py MODULE_SUBDIR spells out where an Algorithm checkpoint keeps its policy
    # (so the command lines find a --checkpoint's policy without importing RLlib): RLlib's names
    import os

    from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_LEARNER_GROUP, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID

    from agents.saved_policy import MODULE_SUBDIR

    assert MODULE_SUBDIR == os.path.join(COMPONENT_LEARNER_GROUP, COMPONENT_LEARNER, COMPONENT_RL_MODULE,
                                         DEFAULT_MODULE_ID)


def test_tune_restores_trials_and_signals_where_the_resume_and_interrupt_hooks_expect():
    # agents/experiment_store.py apply_resume_stop wraps TuneController._restore_trials(self,
    # experiment_state) (the trials of the saved state, before _requeue_restored_trials queues each
    # by its status: a PAUSED one is resumed from its checkpoint, a TERMINATED one skipped) and
    # add_trial(self, trial) (restored trials and the search algorithm's new ones), and sets each
    # trial's stopping_criterion, which Trial.should_stop reads.
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.experiment import Trial

    from agents.experiment_store import apply_resume_stop

    apply_resume_stop(None)
    restore = getattr(TuneController._restore_trials, "original", TuneController._restore_trials)
    add = getattr(TuneController.add_trial, "original", TuneController.add_trial)
    assert params(restore) == ["self", "experiment_state"] and params(add) == ["self", "trial"]
    resume = inspect.getsource(getattr(TuneController.resume, "original", TuneController.resume))
    assert resume.index("self._restore_trials(") < resume.index("self._requeue_restored_trials(trials")
    requeue = inspect.getsource(TuneController._requeue_restored_trials)
    assert "elif trial.status == Trial.TERMINATED:" in requeue and "self.add_trial(trial_to_add)" in requeue
    assert "self._search_alg.next_trial()" in inspect.getsource(TuneController._update_trial_queue)
    assert "self.add_trial(trial)" in inspect.getsource(TuneController._update_trial_queue)
    assert "self.stopping_criterion.items()" in inspect.getsource(Trial.should_stop)
    # agents/workarounds.py note_tune_interrupts wraps ray.tune.tune._setup_signal_catching() (the
    # event Ctrl-C sets), which tune.run calls once per run
    import ray.tune.tune as tune_run

    setup = getattr(tune_run._setup_signal_catching, "original", tune_run._setup_signal_catching)
    assert params(setup) == [] and "experiment_interrupted_event.set()" in inspect.getsource(setup)
    assert "experiment_interrupted_event = _setup_signal_catching()" in inspect.getsource(tune_run.run)

