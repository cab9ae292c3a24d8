"""train: one training job. train.py is the loop a person reads top to bottom (ranks.py, torchrun whose ranks fork
after the imports where there is no GPU, starts it; launch.py starts one per node for training.mode joint); the rest
are its parts: batching, checkpoint and manifest
(checksummed, resumable on another world size), evaluator (held-out loss during training), metrics_logger and
trackers, preemption, watchdog, divergence, trainer_lock, chunked_loss. parallel/ holds the strategies, one module each.
"""
