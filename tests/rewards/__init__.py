"""Tests of hybridrl.rewards."""
