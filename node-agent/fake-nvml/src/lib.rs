//! A fake NVML library (being built).
