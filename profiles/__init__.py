"""Shipped hardware profiles (TOML), installed as minions_local.profiles_data."""
