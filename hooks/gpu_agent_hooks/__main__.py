from gpu_agent_hooks.cli import main

raise SystemExit(main())
