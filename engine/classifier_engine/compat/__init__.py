"""Workarounds for Lightning, torch and jsonargparse, each with its issue, its end and a canary (docs/workarounds.md).

    python -m tools.workarounds_table --write docs/workarounds.md     # the table, from this registry
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    name: str
    where: str  # the code that exists because of it
    upstream: str  # issue or PR
    seen: str  # versions it was seen on
    delete_when: str
    canary: str  # the test in engine/tests/test_compat.py


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        name="Lightning's pytree flattening calls torch's deprecated LeafSpec(): a FutureWarning in every run's output",
        where="classifier_engine/compat/upstream_noise.py quiet_upstream_noise (the warning filtered by its text)",
        upstream="Lightning #21326 (closed, still seen)",
        seen="lightning 2.6.6, torch 2.10-2.14.1",
        delete_when="flattening a batch with lightning.pytorch.utilities._pytree warns nothing",
        canary="test_canary_stock_pytree_flatten_warns_leafspec_is_deprecated",
    ),
    Workaround(
        name="applied instantiation links: LightningCLI saves each link's value into the module's hyperparameters, "
             "also one jsonargparse skipped because the class lacks the argument; a resume then refuses the key",
        where="classifier_engine/compat/ckpt_read_once.py checkpoint_values (drops such a key; "
              "classifier_engine/plan/settings.py LINKED names the links)",
        upstream="Lightning PR #20777 (the feature); no issue found for skipped links (searched 2026-12-06)",
        seen="lightning 2.6.6, jsonargparse 4.53.0",
        delete_when="a model without the argument a link targets gets no such hyperparameter from a stock LightningCLI",
        canary="test_canary_stock_cli_saves_a_skipped_links_value_into_the_hyperparameters",
    ),
    Workaround(
        name="a mid-epoch resume restores the saving run's batch index: a loader with other batches (another world "
             "size or per-process batch) is cut short or overrun (its epoch ends unvalidated), and accumulation "
             "windows shift",
        where="classifier_engine/compat/resume_batches.py continue_epoch_at_batch (called by "
              "classifier_engine/samplers.py ExactLoaders at train start)",
        upstream="Lightning #19764 (open: resuming inside an epoch), #19367 (open: the restored batch progress)",
        seen="lightning 2.6.6",
        delete_when="a stock resume takes the resumed epoch's batch index from the loader's state, or offers a public "
                    "way to set it",
        canary="test_canary_stock_resume_keeps_the_saving_runs_batch_index",
    ),
    Workaround(
        name="Lightning shards a data module's plain evaluation loader with a padded DistributedSampler (samples "
             "repeated where the world size does not divide the split) and cannot resume its training order "
             "mid-epoch; it offers no public hook between the module's loader and its sampler injection",
        where="classifier_engine/samplers.py ExactLoaders: for the run, the module's train/val/test_dataloader are "
              "replaced on the instance by _LoaderHook (its own method, then our samplers; its class is untouched)",
        upstream="Lightning #5060 (closed as a duplicate), #11364 (a warning only); torch #25162 (open)",
        seen="lightning 2.6.6",
        delete_when="stock ddp validation of a plain loader sees each sample once at any world size",
        canary="test_canary_stock_ddp_validation_repeats_samples_of_a_plain_loader",
    ),
    Workaround(
        name="jsonargparse parses `null` on the command line as the string 'None' for an Optional[str] field of a "
             "dataclass argument of a class given by class_path (`--model.group.field=null`)",
        where="classifier_engine/compat/subclass_nulls.py restored_nulls (edits of the run plan's classes pass, "
              "classifier_engine/plan/settings.py)",
        upstream="no upstream issue found (jsonargparse's issues searched 2026-12-03); to report with the canary's "
                 "case",
        seen="jsonargparse 4.53.0, lightning 2.6.6",
        delete_when="a stock LightningCLI in subclass mode parses `--model.group.field=null` as None",
        canary="test_canary_stock_subclass_mode_parses_a_null_dataclass_field_as_the_string_none",
    ),
    Workaround(
        name="LightningCLI parses `--trainer.limit_val_batches=1` as 1.0 (100 %)",
        where="classifier_engine/compat/batch_limits.py: Trainer with int-first limit_*_batches and overfit_batches",
        upstream="Lightning #21259 (typing's Union cache puts float first)",
        seen="lightning 2.5-2.6.6, jsonargparse 4.30-4.53",
        delete_when="a stock LightningCLI parses `--trainer.limit_val_batches=1` as the int 1",
        canary="test_canary_stock_cli_parses_a_batch_limit_of_1_as_a_float",
    ),
    Workaround(
        name="LightningCLI's --ckpt_path replaces explicit --model values with the checkpoint's",
        where="classifier_engine/compat/ckpt_hparams.py explicit_model_values (the run plan's checkpoint values keep "
              "the explicit ones, named in its reason; classifier_engine/plan/settings.py)",
        upstream="introduced by Lightning PR #21116 (2.5.5); fix proposed in PR #21455 (open)",
        seen="lightning 2.5.5-2.6.6",
        delete_when="a stock LightningCLI keeps `--model.x` given next to `--ckpt_path`",
        canary="test_canary_stock_cli_replaces_an_explicit_model_value_with_the_checkpoints",
    ),
    Workaround(
        name="a stateful train loader's state is never restored when configure_optimizers reads "
             "trainer.estimated_stepping_batches (ours does)",
        where="classifier_engine/data/image_data.py ImageDataModule state_dict/load_state_dict (the loader position "
              "restored before the loader is built); classifier_engine/samplers.py ResumableDataLoader iterates lazily",
        upstream="Lightning #20550 (open; fix PRs #21765, #21770)",
        seen="lightning 2.5-2.6.6",
        delete_when="a stock Trainer calls the train loader's load_state_dict on resume despite "
                    "estimated_stepping_batches in configure_optimizers",
        canary="test_canary_stock_trainer_drops_the_loader_state_after_estimated_stepping_batches",
    ),
    Workaround(
        name="ModelCheckpoint(save_last=True) rewrites last.ckpt only when a top-k checkpoint was saved at the same "
             "step: after an epoch that does not improve, last.ckpt is stale",
        where="classifier_engine/run/last_checkpoint.py writes last.ckpt itself (ModelCheckpoint keeps the best only)",
        upstream="introduced by Lightning PR #21244 (2.6.0); no upstream issue found (downstream: "
                 "openclimatefix/pvnet#542)",
        seen="lightning 2.6.0-2.6.6",
        delete_when="stock ModelCheckpoint(save_last=True) rewrites last.ckpt at every epoch end",
        canary="test_canary_stock_save_last_goes_stale_after_an_epoch_that_does_not_improve",
    ),
    Workaround(
        name="`fit --ckpt_path last` looks only in the new run's empty version dir: it starts from scratch",
        where="classifier_engine/run/resume.py (the newest loadable checkpoint under the root; the run continues in "
              "its dir)",
        upstream="Lightning #18524 (open), #2735",
        seen="lightning 2.0-2.6.6",
        delete_when="a stock LightningCLI `fit --ckpt_path last` resumes the previous run",
        canary="test_canary_stock_ckpt_path_last_starts_from_scratch",
    ),
    Workaround(
        name="checkpoint writes are not atomic across filesystems (temp file in $TMPDIR, then a copy in place)",
        where="classifier_engine/storage/files.py atomic_write (temp file beside the target, fsync, rename), which "
              "classifier_engine/run/checkpoint_io.py AtomicCheckpointIO saves through",
        upstream="Lightning #20270, #20780; fsspec #1972 (open: temp file in the target directory)",
        seen="lightning 2.6.6 with fsspec 2026.9.0",
        delete_when="a stock checkpoint save with $TMPDIR on another filesystem replaces the file (a new inode)",
        canary="test_canary_stock_checkpoint_save_rewrites_the_file_in_place_across_filesystems",
    ),
    Workaround(
        name="Lightning's SLURM auto-requeue saves the checkpoint inside the SIGUSR1 handler (can deadlock ddp)",
        where="classifier_engine/run/slurm.py (SLURMEnvironment(auto_requeue=False)); the requeue in "
              "classifier_engine/run/last_checkpoint.py, at an agreed batch end",
        upstream="Lightning #21406 (open; fix PR #21407), #20347",
        seen="lightning 2.4-2.6.6",
        delete_when="stock auto-requeue saves outside the signal handler",
        canary="test_canary_stock_slurm_requeue_saves_inside_the_signal_handler",
    ),
    Workaround(
        name="SIGTERM ends fit with exit code 0 and no checkpoint",
        where="classifier_engine/run/last_checkpoint.py + classifier_engine/run/signals.py (save, then exit 143)",
        upstream="Lightning #19916 (fixed on master by PR #21623, not in 2.6.6)",
        seen="lightning 2.0-2.6.6",
        delete_when="a release with PR #21623: then keep the save, drop the exit-code part",
        canary="test_canary_stock_trainer_exits_0_on_sigterm",
    ),
    Workaround(
        name="a gloo worker thread that releases a finished collective's tensor while its process finalizes takes "
             "the GIL there and aborts it (std::terminate, SIGABRT): a ddp_spawn rank stopped by SIGTERM exits 1, "
             "not 143, now and then",
        where="classifier_engine/compat/gloo_exit.py (a spawned rank that stops leaves with os._exit after the exit "
              "handlers registered since the library's import; armed in classifier_engine/run/last_checkpoint.py)",
        upstream="torch #190489 (open: PyInterpreter.cpp's decref guards on Py_IsInitialized only); PR #179291 "
                 "(abandoned)",
        seen="torch 2.14.1 with gloo, Python 3.11.7",
        delete_when="a gloo worker's release of a tensor during finalization leaves the process's exit code alone",
        canary="test_canary_stock_gloo_worker_aborts_a_process_that_exits_while_it_releases_a_tensor",
    ),
    Workaround(
        name="Lightning broadcasts a SIGTERM flag and reads it on the host at every DDP step",
        where="classifier_engine/compat/sigterm_broadcast.py (skipped; our ranks agree every check_every_n_steps)",
        upstream="Lightning PR #20825 (2.5.2); cost: #21487; PR #21640 (open) would make it every n steps",
        seen="lightning 2.5.2-2.6.6",
        delete_when="the stock epoch loop no longer broadcasts every step",
        canary="test_canary_stock_epoch_loop_broadcasts_sigterm_every_step",
    ),
    Workaround(
        name="values logged with prog_bar=True are read on the host at every batch end, whatever the bar's "
             "refresh rate",
        where="classifier_engine/callbacks/progress_bar.py (the bar reads its values when it refreshes); nothing is "
              "logged with prog_bar=True",
        upstream="no upstream issue found; seen in _LoggerConnector.on_batch_end -> _ResultCollection.metrics",
        seen="lightning 2.6.6",
        delete_when="stock self.log(prog_bar=True) no longer converts to a Python number on every batch",
        canary="test_canary_stock_prog_bar_logging_reads_the_tensor_every_step",
    ),
    Workaround(
        name="every self.log moves the logged metric to the value's device, rebuilding (and deep-copying) its 47 "
             "attributes even when it is already there: ~0.15 ms a call hot, ~0.6 ms in a ResNet-18 CPU step",
        where="classifier_engine/compat/log_device_move.py skip_same_device_moves (training steps; a patch of "
              "classifier_engine/additions.py)",
        upstream="no upstream issue found (#17988 is on_epoch syncing). Proposed: `_ResultMetric.to` returns self when "
                 "is_tensor and `self.value.device == device` (all its tensors move together), or "
                 "`_ResultCollection.log` calls it only when `self[key].value.device != value.device`",
        seen="lightning 2.0-2.6.6 (result.py `self[key].to(value.device)`)",
        delete_when="a stock self.log of a tensor already on the metric's device leaves the metric as it is",
        canary="test_canary_stock_self_log_moves_the_metric_to_the_device_it_is_already_on",
    ),
    Workaround(
        name="every batch, Lightning calls each per-batch hook on every callback and the module, inherited no-ops "
             "too, and inspects the step's signature twice: 1.4M of the 3.8M instructions ours adds to a plain step",
        where="classifier_engine/compat/batch_dispatch.py LeanBatchDispatch (added in classifier_engine/additions.py): "
              "on the engine's and Lightning's callbacks only, never the user's module or callbacks",
        upstream="no upstream issue found (searched 2026-12-03); CPU overhead in general: #8857, #6196 (won't fix)",
        seen="lightning 2.6.6 (trainer/call.py _call_callback_hooks, signature_utils.is_param_in_hook_signature)",
        delete_when="a stock fit skips inherited no-op callback hooks, or inspects the step once (delete that half)",
        canary="test_canary_stock_fit_dispatches_no_op_hooks_and_inspects_the_step_every_batch",
    ),
    Workaround(
        name="CSVLogger deletes the run dir's metrics.csv when a resumed fit starts again there",
        where="classifier_engine/run/trackers.py continue_csv_logs (called from classifier_engine/plan/started.py "
              "take_over): the rows before the checkpoint's step are written back and appended to",
        upstream="introduced by Lightning PR #19446 (2.2.1, for #19432: appending under another header); no "
                 "upstream issue found that asks to keep the rows on a resume",
        seen="lightning 2.2.1-2.6.6",
        delete_when="a stock CSVLogger started again in a version dir keeps the rows its metrics.csv holds",
        canary="test_canary_stock_csv_logger_deletes_metrics_csv_when_it_starts_again",
    ),
    Workaround(
        name="a fit that fails calls each logger's finalize(\"failed\") unguarded: a logger that fails there too "
             "(TensorBoard's flush after its writer thread hit the same full disk) replaces the run's own error",
        where="classifier_engine/errors.py user_message (an ENOSPC/EDQUOT raised while handling a user error is "
              "that error's line)",
        upstream="none found (searched 2026-12-07); lightning/pytorch/trainer/call.py _interrupt",
        seen="lightning 2.6.6",
        delete_when="a stock fit that fails raises its own error when a logger's finalize fails too",
        canary="test_canary_stock_fit_raises_a_loggers_finalize_error_instead_of_its_own",
    ),
    Workaround(
        name="LearningRateMonitor raises without a logger",
        where="classifier_engine/additions.py adds it only when the Trainer has a logger",
        upstream="Lightning #17159 (open, intended behaviour)",
        seen="lightning 2.0-2.6.6",
        delete_when="stock LearningRateMonitor runs without a logger",
        canary="test_canary_stock_learning_rate_monitor_raises_without_a_logger",
    ),
    Workaround(
        name="strategy=\"dp\" was removed from Lightning 2",
        where="classifier_engine/strategies/dp.py (registered as \"dp\")",
        upstream="Lightning PR #16748 (2.0.0)",
        seen="lightning 2.0-2.6.6",
        delete_when="lightning.pytorch.strategies has a DataParallelStrategy again",
        canary="test_canary_stock_lightning_has_no_dp_strategy",
    ),
    Workaround(
        name="torch's DataParallel runs its replicas under the default autocast dtype, not the caller's: "
             "parallel_apply re-enters autocast in each replica's thread with the enabled flag only, and the dtype is "
             "thread-local (bf16-mixed under dp on 2+ GPUs ran float16, without a GradScaler)",
        where="classifier_engine/strategies/dp.py _DataParallel.parallel_apply (each replica re-enters the caller's "
              "dtype in _LightningForward)",
        upstream="no upstream issue found (pytorch's issues searched 2026-12-05); the same thread-local dtype was "
                 "fixed elsewhere: pytorch#125186 (autograd threads), #71124 (checkpoint, PR #71169)",
        seen="torch 2.14.1 (nn/parallel/parallel_apply.py _worker: torch.amp.autocast(device_type, enabled=...))",
        delete_when="stock DataParallel's replicas autocast to the caller's dtype",
        canary="test_canary_stock_data_parallel_replicas_autocast_to_the_default_dtype",
    ),
    Workaround(
        name="torch's SyncBatchNorm refuses CPU tensors (gloo)",
        where="classifier_engine/strategies/sync_batchnorm.py (GlooSyncBatchNorm, swapped in by the plugin "
              "classifier_engine/additions.py adds, on gloo)",
        upstream="no open torch issue; unmerged PRs pytorch#78081, #78078",
        seen="torch 2.4-2.14.1",
        delete_when="torch.nn.SyncBatchNorm's forward accepts CPU tensors",
        canary="test_canary_stock_sync_batchnorm_refuses_cpu_tensors",
    ),
    Workaround(
        name="BaseFinetuning freezes before the DDP wrapper exists: frozen parameters stay out of DDP's gradient "
             "sync after they are unfrozen, and the ranks diverge",
        where="the template's FreezeBackbone callback (a plain Callback using BaseFinetuning's static freeze "
              "helpers: freezes at train start, adds no param group)",
        upstream="Lightning #20340",
        seen="lightning 2.6.6",
        delete_when="a stock BaseFinetuning freeze/unfreeze under ddp keeps the ranks' weights equal",
        canary="test_canary_stock_finetuning_freeze_lets_ddp_ranks_diverge",
    ),
    Workaround(
        name="torch's AveragedModel.update_parameters reads its device-side counter on the host (2 syncs per update), "
             "and Lightning's EMAWeightAveraging averages the whole LightningModule after calling configure_model",
        where="the template's EMA callback (a Callback owning its averaged copy of the "
              "module's network: a foreach lerp per update, the counter on the device)",
        upstream="no upstream issue found; seen in torch/optim/swa_utils.py and lightning weight_averaging.py",
        seen="torch 2.14.1, lightning 2.6.6",
        delete_when="AveragedModel.update_parameters makes no host read of n_averaged",
        canary="test_canary_stock_averaged_model_update_reads_the_counter_on_the_host",
    ),
    Workaround(
        name="a torchrun restart meets the previous attempt's process-group keys in the agent's store: gloo connects "
             "to a dead rank (connectFullMesh fails) or hangs at 'Initializing distributed'",
        where="classifier_engine/compat/elastic_store.py init_attempt_process_group (the default process group on a "
              "PrefixStore named after TORCHELASTIC_RESTART_COUNT; a patch of classifier_engine/additions.py)",
        upstream="pytorch#135712 (closed, still seen); PR #128096 shares the agent's store, PR #135957 dropped the "
                 "per-attempt prefix",
        seen="torch 2.14.1 (static and c10d rendezvous)",
        delete_when="after a torchrun restart the agent's store no longer holds the previous attempt's gloo keys",
        canary="test_canary_stock_torchrun_restart_meets_the_previous_attempts_keys",
    ),
    Workaround(
        name="ModelParallelStrategy ignores sync_batchnorm=True: BatchNorm keeps per-process statistics, unannounced",
        where="classifier_engine/strategies/fsdp.py FSDPStrategy.setup_environment (refused in one line)",
        upstream="no upstream issue found (Lightning's issues searched 2026-12-03): its setup never calls "
                 "_layer_sync.apply, DDPStrategy's does",
        seen="lightning 2.6.6, torch 2.14.1",
        delete_when="a stock ModelParallelStrategy converts the BatchNorm layers with sync_batchnorm=True",
        canary="test_canary_stock_model_parallel_strategy_ignores_sync_batchnorm",
    ),
    Workaround(
        name="torch distributed checkpoint (DCP) reads a folder's .metadata with pickle.load and its non-tensor items "
             "with torch.load(weights_only=False): a crafted sharded checkpoint runs code when it is loaded",
        where="classifier_engine/run/sharded_checkpoints.py MetadataUnpickler, WeightsOnlyLoadPlanner, read_sharded "
              "(called from classifier_engine/run/checkpoint_io.py load_checkpoint)",
        upstream="pytorch#189308 (open; .metadata); fix PR #191326 closed unmerged; load_bytes: no issue found",
        seen="torch 2.14.1 (filesystem.py FileSystemReader.read_metadata, default_planner.py load_bytes)",
        delete_when="stock DCP refuses a pickled global beyond its metadata types in both places",
        canary="test_canary_stock_dcp_runs_code_from_a_crafted_checkpoint",
    ),
    Workaround(
        name="jsonargparse reads a GridSampler's search_space values as Optuna types them (str, float, int, bool, "
             "None: float first): 32 becomes 32.0, which a choice of 32 passes to the fit as `--data.batch_size=32.0`",
        where="classifier_engine/run/sweep.py as_written (the grid's values as the space writes them; called from "
              "check_sweep)",
        upstream="jsonargparse tries a Union's types in order (PR #177; #35 wontfix); optuna's GridValueType puts "
                 "float before int",
        seen="jsonargparse 4.53.0, optuna 5.0.0",
        delete_when="a stock jsonargparse parse of a GridSampler's search_space keeps 32 an int",
        canary="test_canary_stock_parse_of_a_grid_makes_its_integers_floats",
    ),
    Workaround(
        name="MLFlowLogger lets a tracking server that stopped answering end the training: MLflow's client retries "
             "each write for minutes, then log_metrics raises MlflowException out of the fit",
        where="classifier_engine/run/tracker_outage.py OutlivingClient (put in MLFlowLogger._mlflow_client by "
              "outlive_outages, called from classifier_engine/plan/started.py): writes kept in the run dir, sent later",
        upstream="Lightning #12833 (open)",
        seen="lightning 2.6.6, mlflow 3.17.2",
        delete_when="a stock MLFlowLogger's log_metrics returns when its server does not answer",
        canary="test_canary_stock_mlflow_logger_raises_when_its_server_is_gone",
    ),
    Workaround(
        name="LightningCLI calls jsonargparse APIs deprecated in 4.49 that 5.0 removes "
             "(ArgumentParser.add_instantiator, instantiate_classes, dump's skip_none): under jsonargparse 5 the CLI "
             "cannot start",
        where="engine/pyproject.toml caps jsonargparse below 5 (a version range, no code)",
        upstream="Lightning #21900 (closed by PR #21906, which keeps ArgumentParser.add_instantiator: no replacement "
                 "keeps its per-parser scope)",
        seen="lightning 2.6.6, jsonargparse 4.53.0",
        delete_when="a stock LightningCLI calls no jsonargparse API deprecated for removal in 5.0",
        canary="test_canary_stock_cli_calls_jsonargparse_apis_that_5_removes",
    ),
)
