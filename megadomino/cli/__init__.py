"""The command line and the launchers' contracts: Megatron-LM's flags (the policy table in
`flags`), parsing onto the configuration tree (`arguments`), DeepSpeed JSON configs read onto the
same flags (`deepspeed_config`, its table in `deepspeed_keys`), and the launch (`launch`, the one
module that reads the environment: torchrun's, SLURM's and the deepspeed launcher's variables)."""
