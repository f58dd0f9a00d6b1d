"""Shared helpers: run the real trainer in fresh processes on a micro config.

Every training test goes through ``python -m reprotrain.train`` in a subprocess, exactly
as a user would, so process-level state (hash seed, thread count, global RNGs) is fresh. In
the default tier a test's own ``python -m reprotrain...`` commands fork from a warm
interpreter that has imported torch (``tests/warm.py``: the same argv, environment, fresh
entropy and exit as a fresh process; ``REPROTRAIN_TEST_COLD=1``, the slow tier's setting,
starts every one cold).
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import faults

# Idle OpenMP threads sleep instead of spinning: two workers' trainings share the cores, and
# spinning threads took half of their CPU time (a run's bits do not depend on it: the work is
# split alike; run.json notes it, repro/environment.py). Set before any worker or child starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Host facts faked per test (tests/host_facts.py); skips only for a missing device/extra/binary;
# warm starts (tests/warm.py).
pytest_plugins = ("host_facts", "skip_policy", "warm")

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    """In the controller, before any worker starts: byte-compile the package. Where
    PYTHONDONTWRITEBYTECODE is set (CI's host sets it) every trainer and tool process the
    tests start would otherwise compile each module again (0.3 s of CPU a process on the
    Zen 3; stale files are compiled anew, as Python does)."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(REPO / "src", quiet=1)


def _keep_rewritten_test_modules() -> None:
    """pytest rewrites every test module's asserts in each worker, and where
    PYTHONDONTWRITEBYTECODE is set it keeps none of them: 4.5 s of each worker's collection
    (13 s) on a Zen 4. Rewritten modules are kept under build/tests/rewritten/ instead, never
    in tests/ (which holds sources only). pytest writes them as checked-hash pycs, so an
    edited test is rewritten again; a pytest without these names keeps its own behaviour."""
    from _pytest.assertion import rewrite

    needed = ("_rewrite_test", "_write_pyc", "get_cache_dir", "PYC_TAIL", "assertstate_key")
    if not sys.dont_write_bytecode or not all(hasattr(rewrite, n) for n in needed):
        return
    rewrite_test, where = rewrite._rewrite_test, rewrite.get_cache_dir

    def kept(path: Path) -> Path | None:
        """Where a test module's rewritten code is kept; None for any other module."""
        if not path.is_relative_to(REPO / "tests"):
            return None
        return REPO / "build" / "tests" / "rewritten" / path.parent.relative_to(REPO)

    def get_cache_dir(path: Path) -> Path:
        return kept(path) or where(path)

    def rewrite_and_keep(path: Path, config):
        source_hash, code = rewrite_test(path, config)
        if (folder := kept(path)) is not None:
            folder.mkdir(parents=True, exist_ok=True)
            pyc = folder / (path.name[:-3] + rewrite.PYC_TAIL)
            rewrite._write_pyc(config.stash[rewrite.assertstate_key], code, source_hash, pyc)
        return source_hash, code

    rewrite.get_cache_dir, rewrite._rewrite_test = get_cache_dir, rewrite_and_keep


_keep_rewritten_test_modules()


# The framework's own job (src/reprotrain/selfcheck: tiny conv net, synthetic images), shrunk:
# 8 steps per epoch (518 train after the 0.1 val split, 58 val), 2 epochs; a few seconds per
# run on 2 cores. Framework tests never train the user's models or data (tests/starter does).
MICRO = [
    "experiment=selfcheck",
    "dataset.num_train=576",
    "dataset.num_test=256",
    "trainer.batch_size=64",
    "trainer.epochs=2",
]

# reference_run's overrides on top of MICRO (a twin of it must use the same).
REFERENCE = ["trainer.checkpoint_every_steps=3"]

# Three steps of 32 and one evaluation batch: for tests that need a run, not a trained model.
TINY = [
    "dataset.num_train=320",
    "dataset.num_test=64",
    "trainer.batch_size=32",
    "trainer.epochs=1",
    "trainer.limit_train_steps=3",
    "trainer.limit_eval_batches=1",
    "logger=none",
]


def tool_module(name: str) -> str:
    """``reprotrain.tools.<subject>.<name>`` for a tool module's own name (each is unique)."""
    found = sorted((REPO / "src" / "reprotrain" / "tools").glob(f"*/{name}.py"))
    assert len(found) == 1, f"no single tool module named {name}: {found}"
    return f"reprotrain.tools.{found[0].parent.name}.{name}"


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROTRAIN_TEST")}
    env.update(PYTHONHASHSEED="0", **extra)
    return env


def env_without_hashseed() -> dict[str, str]:
    """base_env() less PYTHONHASHSEED: what a user's shell gives the trainer."""
    return {k: v for k, v in base_env().items() if k != "PYTHONHASHSEED"}


def train(
    run_dir: Path,
    *overrides: str,
    env: dict | None = None,
    micro: bool = True,
    timeout: float = 240,
    fault: str | None = None,
) -> subprocess.CompletedProcess:
    """One training run in a fresh process; ``fault`` (tests/faults.py) fires in it."""
    args = [*(MICRO if micro else []), *overrides, f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "reprotrain.train", *args]
    if fault:
        cmd = faults.command(fault, "reprotrain.train", *args)
    return subprocess.run(
        cmd, cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=timeout
    )


def resume(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``make resume RUN=run_dir`` in a fresh process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.runs.resume", str(run_dir), *overrides],
        cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def tool(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m reprotrain.tools.<name>`` in a fresh process (e.g. ``reproduce.reproduce``)."""
    return subprocess.run(
        [sys.executable, "-m", f"reprotrain.tools.{name}", *args],
        cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def run_json(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def metrics_without_timings(run_dir: Path) -> list[dict]:
    rows = jsonl(Path(run_dir) / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in rows]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """One uninterrupted micro run with mid-epoch checkpoints every 3 steps. Started without
    PYTHONHASHSEED (the entry point re-execs itself with it fixed), so it is also the first
    of test_train.py's twins."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    assert_ok(train(run_dir, *REFERENCE, env=env_without_hashseed()))
    return run_dir


# The slow tier (`make test-slow`; CI runs it after `make test`): every test here trains
# several runs, a DDP job or a real replay. `make test` keeps one test per promise (bitwise
# twins, a SIGKILL resume, archive -> REPRODUCED, a task seam example, world size 1 vs 2
# (in process), bisect, a new model by YAML, eval, the non-finite guard, the refusals, a run
# dir written once) so it stays under 5 minutes on 2 cores.
SLOW = {
    "test_archive.py::test_a_code_change_inside_the_archive_diverges",
    "test_archive.py::test_an_interrupted_archive_compares_the_epochs_it_completed",
    "test_archive.py::test_changed_dataset_is_refused_then_replayed_as_not_comparable",
    "test_archive.py::test_environment_difference_is_not_comparable",
    "test_archive.py::test_reproduce_runs_the_archived_source_not_the_working_tree",
    "test_ddp.py::*",
    "test_debug_presets.py::*",
    "test_distributed.py::test_a_signal_to_one_rank_stops_every_rank_after_the_same_step",
    "test_distributed.py::test_sigkill_of_torchruns_process_group_leaves_no_worker_running",
    "test_distributed.py::test_submitit_tasks_become_ddp_ranks_without_torchrun",
    "test_distributed.py::test_two_ranks_share_rank0s_run_dir_gather_rng_and_shard_the_global_batch",
    "test_distributed.py::test_two_torchrun_agents_with_c10d_rendezvous_form_one_two_node_job",
    "test_reference_job.py::test_smoke_bits_are_the_same_in_the_template_and_a_new_project",
    "test_interruptions.py::test_a_full_disk_names_the_path_and_leaves_the_run_failed[metrics.jsonl]",
    "test_report.py::test_report_of_a_real_training_run",
    "test_resume.py::test_external_sigterm_with_two_loader_workers",
    "test_resume.py::test_extending_epochs_is_allowed",
    "test_resume.py::test_fp16_grad_scaler_state_survives_a_kill",
    "test_resume.py::test_requeue_with_the_same_command_and_resume_auto",
    "test_resume.py::test_second_sigint_aborts_at_once_and_earlier_checkpoints_stay_valid",
    "test_resume.py::test_sigkill_on_the_loader_path_with_two_workers",
    "test_resume.py::test_sigkill_then_resume_is_bitwise_equal[after-save:8]",
    "test_resume.py::test_sigkill_then_resume_is_bitwise_equal[in-save:12]",
    "test_resume.py::test_sigterm_checkpoints_marks_interrupted_and_resumes",
    "test_resume.py::test_truncated_newest_checkpoint_falls_back_in_one_line",
    "test_resume_edges.py::test_resume_that_extends_the_schedule_is_recorded_and_reproduces_bitwise",
    "test_resume_edges.py::test_stop_at_global_step_checkpoints_there_and_exits_75",
    "test_resume_edges.py::test_checkpoints_without_a_record_are_refused_in_one_line",
    "test_resume_edges.py::test_resume_from_another_runs_checkpoint_forks_a_new_run",
    "test_rng.py::test_under_ddp_the_entry_holds_every_rank_in_rank_order",
    "test_seeing.py::test_debug_fast_runs_at_most_ten_steps",
    "test_seeing.py::test_nonfinite_warn_records_and_goes_on_with_strict_json",
    "test_seeing.py::test_tensorboard_has_one_point_per_step_and_logger_none_keeps_the_bits",
    "test_sweep.py::test_a_real_seed_sweep_leaves_a_summary_and_a_plot",
    "test_template.py::test_an_optimizer_by_yaml_alone_trains_and_is_named",
    "test_template.py::test_bad_image_folders_are_one_line",
    "test_template.py::test_image_folder_sigkill_mid_epoch_then_resume_is_bitwise",
    "test_template.py::test_image_folder_trains_and_num_workers_do_not_change_the_bits",
    "test_template.py::test_no_decay_group_for_norms_and_biases_is_recorded",
    "test_throughput_options.py::*",
    "test_trust.py::test_a_trusted_signature_runs_it_and_says_so",
    "test_trust.py::test_an_untouched_archive_of_a_commit_here_runs_under_rule_a",
    "test_trust.py::test_trust_1_runs_it_and_says_so",
    "test_train.py::test_changing_only_the_data_stream_keeps_init_and_changes_the_result",
    "test_train.py::test_different_base_seed_gives_different_weights",
    "test_train.py::test_loader_path_is_independent_of_num_workers",
    "test_reference_job.py::test_smoke_experiment_learns",
    "test_train.py::test_sweep_writes_a_summary_over_seeds",
    "test_train.py::test_verify_passes_for_a_seeded_config_and_names_epoch_1_for_entropy",
    # Issue 20: the default tier keeps one test per promise within 5 minutes on 2 cores;
    # these are the second and later tests of a promise the default tier already checks.
    "test_archive.py::test_sigterm_to_reproduce_reaches_the_rerun_and_leaves_no_temp_dir",
    "test_best_checkpoint.py::test_kill_between_step_and_best_then_resume_gives_the_uninterrupted_best",
    "test_interruptions.py::test_a_full_disk_names_the_path_and_leaves_the_run_failed",
    "test_interruptions.py::test_a_killed_loader_worker_ends_the_run_in_one_line_and_resumes_bitwise",
    "test_interruptions.py::test_tensorboard_after_a_kill_and_resume_has_every_step_exactly_once",
    "test_microbatch.py::test_sigkill_between_microbatches_resumes_bitwise",
    "test_resume.py::test_other_torch_version_is_warned_and_recorded",
    "test_run_dir.py::test_resume_auto_into_an_empty_dir_starts_fresh",
    "test_example_tasks.py::test_mixup_task_repeats_bitwise",
    "test_user_experiments.py::test_two_fresh_runs_are_identical[sequence]",
    "test_user_experiments.py::test_two_fresh_runs_are_identical[dict_microbatches]",
    "test_user_experiments.py::test_sigkill_mid_epoch_then_resume_is_bitwise_equal[sequence]",
    "test_user_experiments.py::test_sigkill_mid_epoch_then_resume_is_bitwise_equal[dict_microbatches]",
    "test_world_size_invariance.py::test_a_two_process_run_killed_mid_epoch_resumes_on_one_process_bitwise",
    # Siblings in make test: test_reduction.py (two ranks of Exact give one process's bits,
    # in process), tests/starter/test_readme_model.py (a model by YAML), test_resume.py (a
    # SIGKILL resume), test_cli_main.py's compare exit codes, test_docs_defects.py (bash
    # completion), test_early_stopping.py's stop, test_write_once.py's refusals.
    "test_world_size_invariance.py::test_one_and_two_processes_give_the_same_weights_losses_and_metrics",
    "test_template.py::test_a_new_model_module_and_yaml_train_bitwise_repeatably",
    "test_user_experiments.py::test_sigkill_mid_epoch_then_resume_is_bitwise_equal[regression]",
    "test_cli_main.py::test_bisect_of_identical_records_is_exit_0_through_the_console_script",
    "test_cli_main.py::test_sigterm_sent_to_reprotrain_reaches_the_trainer",
    "test_cli_main.py::test_bash_completes_train_overrides_from_the_config_tree",
    "test_early_stopping.py::test_killed_after_the_stopping_epochs_checkpoint_the_resume_stops_with_the_same_bits",
    "test_early_stopping.py::test_off_by_default_and_a_real_improvement_resets_the_count",
    "test_example_tasks.py::test_second_loss_term_is_trained_and_logged_by_name",
    "test_tasks.py::test_run_json_shows_the_optimizers_own_lr",
    "test_write_once.py::test_a_continued_run_keeps_the_hydra_record_it_started_with",
    "test_new_project.py::test_a_new_projects_make_test_runs_its_own_tests_and_template_targets_say_where_they_live",
    # Siblings: the portable pin (test_reference_job.py), make resume (test_resume.py).
    "test_reference_job.py::test_micro_smoke_bits_are_pinned_and_one_microbatch_keeps_them",
    "test_archive.py::test_make_resume_continues_a_run_whose_dir_needs_quoting",
    # Siblings: make eval's exact final metrics (test_seeing.py), the trainer's own refusal
    # of a used run dir (test_run_dir.py, test_write_once.py), test_help.py's --help.
    "test_seeing.py::test_eval_of_an_ema_run_uses_the_ema_weights_and_reproduces_its_final_test_metrics",
    "test_run_dir.py::test_a_fresh_run_into_a_used_run_dir_is_refused_and_the_old_run_is_intact",
    "test_cli_main.py::test_train_help_is_the_trainers_own_through_the_console_script",
    # Siblings: test_world_size_invariance.py's check_layout refusal (the check a resume
    # runs), test_write_once.py's already-completed resume.
    "test_world_size_invariance.py::test_resume_on_a_world_size_that_does_not_divide_k_is_refused",
    "test_resume_edges.py::test_completed_run_says_already_completed_and_rewrites_nothing",
    # Issues 34 and 38 (2026-12-02, AMD EPYC Zen 3: make test took 9 min 24 s): second tests
    # of a promise. Siblings: the purity check's in-process tests (each impurity found and
    # named, test_sample_purity.py); the strict refusal of an unverifiable resume
    # (test_resume_replay.py) and the audit's own tests; the first pty test of the bar.
    "test_sample_purity.py::test_a_run_whose_samples_keep_their_own_rng_is_refused_under_strict_and_flagged_at_warn",
    "test_resume_audit.py::test_strict_refuses_a_resume_that_cannot_be_bitwise_then_the_flag_records_why",
    "test_epoch_bar.py::test_on_a_pseudo_terminal_a_stops_lines_go_above_the_open_bar_and_it_is_erased",
    # make test at 5 min 43 s on the Zen 3 (2026-12-02, third session): second tests of a
    # promise. Siblings: test_resume.py's SIGKILL resumes (their record says what the replay
    # found), the callbacks' in-process guard and round-trip tests, the bar's in-process
    # whole-line test, bisect's digest tests, the starter's step that repeats bitwise.
    "test_resume_replay.py::test_a_private_counter_resumed_from_the_first_checkpoint_is_replayed_and_bitwise",
    "test_callbacks.py::test_callbacks_change_no_bits_and_a_callback_with_state_resumes_bitwise",
    "test_epoch_bar.py::test_on_a_pseudo_terminal_every_log_line_is_whole_and_no_bar_is_left",
    "test_bisect.py::test_thread_counts_name_the_first_divergent_step_and_an_aten_op_in_a_module",
    "test_bisect.py::test_a_difference_made_before_the_traced_step_is_walked_back_to_its_op",
    "test_user_experiments.py::test_two_fresh_runs_are_identical[regression]",
    # make test at 4 min 54 s to 6 min 1 s on a Zen 4 (2026-12-03): second tests of a
    # promise. Siblings: a regression task's exact rmse and r2 (test_tasks.py), its report
    # (test_report_metrics.py) and summary (test_metrics_by_name.py); tags composed into the
    # config, outside its identity (test_tags_local_presets.py).
    "test_user_experiments.py::test_regression_records_rmse_and_r2_and_no_accuracy",
    "test_tags_local_presets.py::test_a_runs_tags_are_in_its_run_json",
    # The data kind of issue 34 end to end (sibling: test_code_identity.py's unit test of
    # the kept fingerprint and the named change).
    "test_template.py::test_images_edited_between_a_kill_and_the_resume_are_named_and_never_re_recorded",
    # make test at 4 min 31 s to 4 min 45 s on a Zen 4 (2026-12-07): second tests of a promise.
    # Siblings: the container line of a reproduce (test_container.py, in process) and an
    # archive REPRODUCED bitwise (test_archive.py); every numpy bit generator saved and
    # restored and the unknown one refused in one line (test_rng.py, in process); the read
    # counter named by the audit (test_resume_audit.py) and a private counter refused end to
    # end (test_resume_replay.py); compare's three exit codes through make and the console
    # script (test_cli_main.py's make test) and its numbers (test_statistical_verdict.py);
    # the legacy API's refusal (Lightning's advice: the same read-back refuses every setting);
    # the absolute path's reproduce and each attack in process (test_config_paths.py); the
    # users' dispatch variables refused under portable (test_portable.py, in process); the
    # levers read back in the pinned portable run's record (test_reference_job.py).
    "test_container.py::test_reproduce_of_a_containerised_run_names_its_image_and_base_and_bits_decide",
    "test_rng.py::test_a_model_installing_a_pcg64_resumes_bitwise_and_another_kind_is_refused_in_one_line",
    "test_resume_replay.py::test_a_training_datasets_read_counter_is_refused_under_strict_and_named_when_allowed",
    "test_cli_main.py::test_compare_keeps_its_verdict_codes_through_the_console_script",
    "test_precision.py::test_a_process_where_other_code_set_the_settings_is_refused_in_one_line"
    "[torch.backends.cuda.matmul.fp32_precision = 'tf32']",
    "test_precision.py::test_a_process_where_other_code_set_the_settings_is_refused_in_one_line"
    "[torch.backends.fp32_precision = 'tf32']",
    "test_config_paths.py::test_reproduce_of_an_archive_whose_csv_file_leaves_the_run_writes_nothing_outside[dotdot]",
    "test_portable.py::test_the_entry_point_refuses_portable_with_a_users_mkl_branch_in_one_line",
    "test_portable.py::test_the_libraries_read_the_portable_levers_back",
    "test_portable.py::test_mkls_avx2_branch_holds_on_intel_only_so_portable_uses_compatible",
}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        file, _, name = item.nodeid.rpartition("/")[2].partition("::")
        base = name.split("[")[0]
        if {f"{file}::*", f"{file}::{name}", f"{file}::{base}"} & SLOW:
            item.add_marker(pytest.mark.slow)
