"""FX graph passes (installed as `fx_fp8.passes`): one class per pass, a manager, filters."""
