"""Each `train.stage` bound to the trainer that runs it, from the stage's spec (config/stages.py).

build.py picks the trainer of a run; preference.py binds dpo, kto and rm to TRL's trainers,
online_rl.py grpo and rloo, distill.py distill (with its teacher, train/teacher.py); binding.py
resolves the classes a spec names. pretrain and sft run HF Trainer over lmforge's own prepared
samples and collators (train/hf_trainer.py).
"""
