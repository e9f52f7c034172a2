#!/usr/bin/env bash
# The GPU checks of docs/results/gpu.md in one command, for the GPU machine (../shared/gpu/README.md):
#   source .gpu/env.sh; benchmarks/gpu_checks.sh [STEP ...]
# Steps (default: tests rollouts peer weights), with their wall time on 2026-11-26 (one H100; the
# machine's start took about 30 s more):
#   tests      the CUDA-only tests and their files (79 s before the guided ones were added)
#   captured   the tests that the captured CUDA graph step and a block of steps give the eager
#              steps' tokens (23 s)
#   rollouts   rollout_throughput.py at GPT-2-small shape, batch 128, --reps ${REPS:-3} (97 s; 100 s
#              at --reps 2)
#   peer       peer_trl.py on cuda, 60 s each side, the project's defaults (150-162 s; needs TRL in
#              the bundle: install benchmarks/requirements-peers.txt before bundle.sh)
#   weights    weight_sync.py, colocated and one remote EnvRunner (32 + 44 s)
#   profile    decode_step_profile.py: the step by precision, its kernels, a restart step's ops (98 s)
#   compiled_step  decode_step_profile.py --compile: the bf16 captured step as it is and through
#              torch.compile (inductor; env_runners.compile_step), with the compile's seconds, then
#              the compiled step's CUDA test (not yet run); where it is faster, COMPILE=1 peer runs
#              the PPO side with env_runners.compile_step true
#   serve      serve_load.py, one replica on the CPU and one on the GPU, on the replica's own port
#              (agents.serve --direct-port; not yet run)
#   learner_pass  learner_pass.py: a bf16 learner pass at the peer shape, transformers' forward against
#              the tensor-op pass the learner takes under bf16 autocast (run 2026-11-26)
#   seeds      the project side of peer_trl.py alone (its peer settings, 60 s each) with fp32 and
#              bf16 rollouts, for each seed in SEEDS (default "1 2"): whether bf16 rollouts reach
#              fp32's reward (about 75 s a run; run 2026-11-26)
#   ppo_profile  ppo_profile.py: a colocated PPO iteration's time by phase, host clock, synced and
#              under torch.profiler (36-45 s)
#   restarts   the captured-step tests (restarting rows prefilled inside the captured step, a
#              block's later steps as one graph), then ppo_profile as before both (eager restarts,
#              one replay per step), with the restarts in the step, and with both (the default;
#              about 45 s each; not yet run)
#   evaluation rollout_throughput.py as rollouts_bf16 (--reps 2), with the fast EnvRunner's greedy
#              evaluation at decode_block 1 and 4 (rows g1, g4): evaluation on the learner's GPU
#              in bf16 and blocks of 4, as a colocated run evaluates (not yet run)
#   generate   generate_loop.py at GPT-2-small shape (vocabulary 50,257, bf16 weights), batches of 16
#              and 64, sampled then greedy: generate() on the decode engine in blocks (decoder)
#              against one module call per token (stepwise), same run (not yet run)
#   serve_batch  serve_batch.py at GPT-2-small shape (vocabulary 50,257, bf16 weights): a replica's
#              continuous batching in-process, 16 and 64 rows, blocks of 8 on the decode engine
#              against one module call per token, then the mix of per-request settings, then a lone
#              client on 64 rows (--one-by-one: one row stepped, its graphs captured apart) (not yet run)
# rollouts_bf16, peer_bf16 and peer_fp32: the same with the rollouts' weights in bf16 or fp32
# (env_runners.precision; its default, auto, is bf16 on a GPU with bf16, so peer is peer_bf16 there);
# rollouts_tf32: fp32 weights with TF32 matmuls on every path (as a training run's process has them).
#   static     the static update's tests (the CUDA one: captured replays against eager updates),
#              then ppo_profile with RLlib's update and with training.static_update (126 s on
#              2026-11-27)
#   static_long  the project side of peer_trl.py alone (its peer settings) for 120 s, with RLlib's
#              update and with training.static_update, for each seed in SEEDS (default "0"):
#              whether the captured update's reward holds as long as RLlib's does, over time and
#              by the updates made ("reward by iteration"; about 140 s a run; run 9)
#   static_graphs  the project side of peer_trl.py with training.static_update for 90 s each with
#              at most 8 (the default), 0 (the static function run eagerly on the GPU) and 1
#              captured buckets, each iteration's learner metrics in $OUT/static_graphs_<n>.jsonl:
#              whether a reward that falls falls with capture, with several graphs in one pool, or
#              with the static function itself (about 120 s a run)
#   static_verify  the same with 8 graphs for 120 s, every update also run eagerly from the same
#              state and compared (benchmarks/static_verify.py; training goes on from the replay's
#              result): whether any replay's update departs from the eager one, and when
#              ("replay checks" line; each iteration's checks in $OUT/static_verify.jsonl)
#   static_graphs and static_verify end with benchmarks/learner_log.py's summary of their logs
#   (captures, the bucket each late update took, the reward's falls); POOLS=private runs them with
#   each captured bucket in its own memory pool (--static-private-pools; logs named <step>_private)
# STATIC=1 runs peer, seeds and ppo_profile with training.static_update true (the learner's update
# captured as CUDA graphs); their logs are then named <step>_static.
# FLOOR=x does the same with training.advantage_std_floor x (advantages divided by at least x, not
# by their own std alone: docs/results/plateau.md); logs named <step>_floor<x>.
# CLIP=1 does the same with training.update_clipping true (StableAdamW's update clipping on the
# learner's Adam: docs/results/plateau.md); logs named <step>_clip.
#   plateau    the project side of peer_trl.py alone (its peer settings) with training.static_update
#              for 120 s, for each variant in PLATEAU (default "clipped standardized unscaled": with
#              update clipping, RLlib's standardized advantages as they are, centred and unscaled
#              ones), each iteration's learner metrics in $OUT/plateau_<variant>.jsonl, then
#              learner_log.py's summary: the updates with a KL above 0.1 once the policy is nearly
#              deterministic, the reward's falls (about 140 s a run; not yet run)
# COMPILE=1 does the same with env_runners.compile_step true (the rollout step through torch.compile
# before capture; the compile falls in the first iteration); logs named <step>_compiled.
# BLOCK=k runs rollouts, peer and ppo_profile with env_runners.decode_block k (k module steps per
# env round trip; unset, the config's default: 4 on a GPU); their logs are then named <step>_block<k>.
# Each step runs under its own time limit and writes its whole output to $OUT/<step>.log (OUT
# defaults to ./gpu_out), so a step that fails or runs out of time leaves the others' figures.
# Prints only measured figures; it never passes or fails on a time.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
steps=("$@")
BLOCK=${BLOCK:-}
tag=${BLOCK:+_block$BLOCK}
block_arg=(${BLOCK:+--decode-block "$BLOCK"})
block_only=(${BLOCK:+--set env_runners.decode_block="$BLOCK"})
block_set=("${block_only[@]}" ${STATIC:+--set training.static_update=true} ${COMPILE:+--set env_runners.compile_step=true}
           ${FLOOR:+--set training.advantage_std_floor="$FLOOR"} ${CLIP:+--set training.update_clipping=true})
tag_only=$tag
pool_arg=(${POOLS:+--static-private-pools})  # POOLS=private
pool_tag=${POOLS:+_$POOLS}
tag=$tag${STATIC:+_static}${COMPILE:+_compiled}${FLOOR:+_floor$FLOOR}${CLIP:+_clip}
[ ${#steps[@]} -gt 0 ] || steps=(tests rollouts peer weights)

run() {  # run NAME LIMIT_S CMD...: the command's output into $OUT/NAME.log, its tail and status here
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i -E "warning|warn\(|deprecat|^\s*$" "$OUT/$name.log" | tail -n 40
  echo "== $name: exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (time limit ${limit} s)")"
}

$PY - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", flush=True)
EOF

for step in "${steps[@]}"; do
  case $step in
    tests) run tests 180 $PY -m pytest -q -p no:cacheprovider tests/test_decode_engine.py tests/test_weight_sync.py \
             tests/test_static_update.py tests/test_generate_decoder.py \
             "tests/test_config.py::test_generate_refuses_prompt_words_outside_the_vocabulary_naming_the_prompt" \
             "tests/test_serve_batching.py::test_a_replica_on_a_gpu_writes_what_the_cpu_replica_writes" \
             "tests/test_serve_batching.py::test_a_gpu_replica_draws_sampled_completions_with_every_request_sampler_on_the_device" \
             "tests/test_serve_batching.py::test_generate_on_a_gpu_draws_on_the_device_and_repeats_for_a_seed" \
             tests/test_serve_blocks.py \
             "tests/test_guided.py::test_lm_guide_samples_its_distribution_on_the_rollout_device_from_its_own_generator" \
             "tests/test_guided.py::test_ppo_pp_with_an_lm_guide_trains_with_its_rollouts_on_the_learners_device" ;;
    rollouts|rollouts_bf16|rollouts_tf32) precision=$([ "$step" = rollouts_bf16 ] && echo bf16 || echo fp32)
             tf32=$([ "$step" = rollouts_tf32 ] && echo --tf32 || true)
             run "$step$tag" 200 $PY benchmarks/rollout_throughput.py --device cuda --batch 128 \
             --model gpt2-small-shaped --vocab 50257 --reps "${REPS:-3}" --precision "$precision" \
             $tf32 "${block_arg[@]}" ;;
    evaluation) run "evaluation$tag" 200 $PY benchmarks/rollout_throughput.py --device cuda --batch 128 \
             --model gpt2-small-shaped --vocab 50257 --reps 2 --greedy-blocks 1 4 --precision bf16 ;;
    generate) for greedy in "" --greedy; do
             run "generate${greedy:+_greedy}$tag" 200 $PY benchmarks/generate_loop.py --device cuda \
             --model gpt2-small-shaped --vocab 50257 --batch 16 64 --reps 3 --precision bf16 \
             --paths decoder stepwise $greedy; done ;;
    serve_batch) for rows in 16 64; do
             run "serve_batch_rows$rows$tag" 200 $PY benchmarks/serve_batch.py --device cuda \
             --model gpt2-small-shaped --vocab 50257 --rows "$rows" --completions $((rows * 8)) --reps 3 \
             --precision bf16; done
             run "serve_batch_settings$tag" 200 $PY benchmarks/serve_batch.py --device cuda \
             --model gpt2-small-shaped --vocab 50257 --rows 16 --completions 128 --reps 3 --precision bf16 \
             --mix settings
             run "serve_batch_lone$tag" 200 $PY benchmarks/serve_batch.py --device cuda \
             --model gpt2-small-shaped --vocab 50257 --rows 64 --completions 32 --new 64 --one-by-one \
             --paths blocks --reps 2 --precision bf16 ;;
    seeds) for seed in ${SEEDS:-1 2}; do for precision in fp32 bf16; do
             run "seeds_${precision}_seed$seed$tag" 150 $PY benchmarks/peer_trl.py --device cuda \
             --model gpt2-small-shaped --seconds 60 --project-only \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set env_runners.precision="$precision" --set seed="$seed" "${block_set[@]}"
           done; done ;;
    peer|peer_bf16|peer_fp32) precision=${step#peer_}; [ "$step" = peer ] && precision=auto
             $PY -c "import trl" 2>/dev/null || { echo "== $step: skipped: no TRL here (pip install -r benchmarks/requirements-peers.txt, then bundle.sh again)"; continue; }
             run "$step$tag" 260 $PY benchmarks/peer_trl.py --device cuda --model gpt2-small-shaped --seconds 60 \
             --trl-lr 1e-4 --trl-steps-per-generation 2 --plot "$OUT/$step$tag.png" \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set env_runners.precision="$precision" "${block_set[@]}" ;;
    plateau) for variant in ${PLATEAU:-clipped standardized unscaled}; do
             case $variant in clipped) extra=(--set training.update_clipping=true) ;;
               unscaled) extra=(--set training.advantage_std_floor=1) ;; *) extra=() ;; esac
             run "plateau_$variant$tag_only" 200 $PY benchmarks/peer_trl.py --device cuda \
             --model gpt2-small-shaped --seconds 120 --project-only --plot "$OUT/plateau_$variant.png" \
             --learner-log "$OUT/plateau_$variant.jsonl" \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set training.static_update=true "${extra[@]}" \
             --set seed=0 "${block_only[@]}"
           done
           run plateau_summary 30 $PY benchmarks/learner_log.py "$OUT"/plateau_*.jsonl ;;
    static_long) for seed in ${SEEDS:-0}; do for update in false true; do
             run "static_long_${update}_seed$seed$tag_only" 200 $PY benchmarks/peer_trl.py --device cuda \
             --model gpt2-small-shaped --seconds 120 --project-only --plot "$OUT/static_long_${update}_seed$seed.png" \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set training.static_update=$update --set seed="$seed" "${block_only[@]}"
           done; done ;;
    static_graphs) for graphs in 8 0 1; do
             run "static_graphs_$graphs$tag_only$pool_tag" 150 $PY benchmarks/peer_trl.py --device cuda \
             --model gpt2-small-shaped --seconds 90 --project-only --static-max-graphs $graphs "${pool_arg[@]}" \
             --learner-log "$OUT/static_graphs_$graphs$pool_tag.jsonl" --plot "$OUT/static_graphs_$graphs$pool_tag.png" \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set training.static_update=true --set seed=0 "${block_only[@]}"
           done
           run "static_graphs_summary$pool_tag" 30 $PY benchmarks/learner_log.py \
             "$OUT"/static_graphs_{8,0,1}$pool_tag.jsonl ;;
    static_verify) run "static_verify$tag_only$pool_tag" 200 $PY benchmarks/peer_trl.py --device cuda \
             --model gpt2-small-shaped --seconds 120 --project-only --static-verify-every 1 "${pool_arg[@]}" \
             --learner-log "$OUT/static_verify$pool_tag.jsonl" --plot "$OUT/static_verify$pool_tag.png" \
             --set env_runners.num_envs_per_env_runner=128 --set training.train_batch_size=2560 \
             --set training.minibatch_size=2560 --set training.num_epochs=1 --set reward.kl_coef=0 \
             --set training.lr=1e-4 --set training.static_update=true --set seed=0 "${block_only[@]}"
           run "static_verify_summary$pool_tag" 30 $PY benchmarks/learner_log.py "$OUT/static_verify$pool_tag.jsonl" ;;
    learner_pass) run learner_pass 120 $PY benchmarks/learner_pass.py --device cuda --reps 20 ;;
    profile) run profile 170 $PY benchmarks/decode_step_profile.py ;;
    compiled_step) run compiled_step 300 $PY benchmarks/decode_step_profile.py --compile
             run compiled_step_test 200 $PY -m pytest -q -p no:cacheprovider \
             "tests/test_decode_engine.py::test_a_compiled_step_gives_the_eager_steps_tokens" ;;
    ppo_profile) run "ppo_profile$tag" 240 $PY benchmarks/ppo_profile.py --device cuda --model gpt2-small-shaped \
             --iters 6 --trace "$OUT/ppo_trace$tag.json" "${block_set[@]}" ;;
    restarts) run restarts_tests 90 $PY -m pytest -q -p no:cacheprovider \
             tests/test_decode_engine.py::test_captured_cuda_graph_step_gives_the_eager_steps_tokens \
             "tests/test_decode_engine.py::test_a_block_of_steps_on_the_device_gives_one_act_per_step[cuda]" \
             tests/test_reinforce.py::test_greedy_decodes_on_cuda_replay_their_graphs_and_equal_the_eager_decodes
            for path in eager,each static,each static,graph; do
              run "ppo_profile_restarts_${path/,/_}$tag" 240 $PY benchmarks/ppo_profile.py --device cuda \
              --model gpt2-small-shaped --iters 6 --restarts "${path%,*}" --block-steps "${path#*,}" "${block_set[@]}"
            done ;;
    static) run static_tests 120 $PY -m pytest -q -p no:cacheprovider tests/test_static_update.py
            for update in false true; do
              run "ppo_profile_static_$update$tag_only" 240 $PY benchmarks/ppo_profile.py --device cuda \
              --model gpt2-small-shaped --iters 6 --set training.static_update=$update "${block_only[@]}"
            done ;;
    captured) run captured 60 $PY -m pytest -q -p no:cacheprovider \
             tests/test_decode_engine.py::test_captured_cuda_graph_step_gives_the_eager_steps_tokens \
             "tests/test_decode_engine.py::test_a_block_of_steps_on_the_device_gives_one_act_per_step[cuda]" ;;
    weights) run weights_colocated 90 $PY benchmarks/weight_sync.py --device cuda --reps 5
             run weights_remote 120 $PY benchmarks/weight_sync.py --device cuda --remote --precision bf16 --reps 5 ;;
    serve) run serve_cpu 150 $PY benchmarks/serve_load.py --replicas 1 --batch-rows 0 16 --clients 1 8 16 \
             --requests 200 --stream off --ingress direct
           run serve_gpu 150 $PY benchmarks/serve_load.py --replicas 1 --batch-rows 0 16 --clients 1 8 16 \
             --requests 200 --stream off --ingress direct --serve-args "--num-gpus 1" ;;
    *) echo "unknown step: $step (tests static static_long static_graphs static_verify compiled_step restarts captured rollouts evaluation generate serve_batch rollouts_bf16 rollouts_tf32 peer peer_bf16 peer_fp32 seeds learner_pass weights profile ppo_profile serve plateau)" >&2
       exit 2 ;;
  esac
done
