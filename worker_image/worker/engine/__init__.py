"""Engine drivers: EngineCore.step() (schedule -> run -> update), the offline LLM API and the async engine with per-request streams."""
