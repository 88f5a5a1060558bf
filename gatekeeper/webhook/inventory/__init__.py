"""What is committed where: per GPU, memory and shares allocated against capacity (ResourceSlices + ResourceClaims)."""
