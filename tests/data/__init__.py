"""Tests of hybridrl.data."""
