/* core/timer.h: monotonic wall clock in seconds. */
#ifndef CT_CORE_TIMER_H
#define CT_CORE_TIMER_H

double ct_now(void);

#endif
