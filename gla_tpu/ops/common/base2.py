"""Constants of the softmax kernels that exponentiate in base 2: exp(x) = exp2(x * LOG2_E), so
scaling the scores by sm_scale * LOG2_E saves the multiply that exp itself would do; a base-2
log-sum-exp times LN_2 is the natural one."""

import math

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
