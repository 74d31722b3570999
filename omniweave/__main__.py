from omniweave.cli import main
from omniweave.launch import leave

leave(main())
