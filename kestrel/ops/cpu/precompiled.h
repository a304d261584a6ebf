// The headers every kernel includes (torch's, ~10 s to parse each time), compiled once per build into a precompiled
// header that each source is compiled with (kestrel.ops.cpu._compile); each source still includes what it uses.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>
