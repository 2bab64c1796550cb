from gpu_agent.cli import entry

entry()
