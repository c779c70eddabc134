// Nothing: the target that owns the precompiled <torch/torch.h> needs one
// source of its own (see geotrain_torch_pch() in the top CMakeLists.txt).
