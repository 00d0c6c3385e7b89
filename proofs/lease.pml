/*
 * Roundtable's write protocol: claim / hold (renew) / call / record / settle /
 * recover / reconcile, and decide / extend / expire / withdraw for approvals.
 *
 * proofs/README.md says what each process and label stands for in the code
 * (file and function), the bounds, the invariants and what is left out.
 * Change the model and that table together with the code.
 *
 * Builds (see the Makefile's `proofs` target):
 *   spin -a lease.pml                                  every check must hold
 *   spin -a -DFROZEN_CALL lease.pml                    a worker frozen inside its
 *                                                      tool call: the fence's checks hold
 *   spin -a -DBUG_KEEPER_LETS_GO_AT_CANCEL lease.pml   must FAIL (the first fix: the call is
 *                                                      cancelled, but not held while it stops)
 *   spin -a -DFROZEN_CALL -DSTRICT lease.pml           must FAIL (a frozen call may still
 *                                                      run when reconciled; the fence stops its write)
 *   spin -a -DFROZEN_CALL -DNO_FENCE lease.pml         must FAIL (the late write lands)
 *   spin -a -DBUG_LOST_LEASE_KEEPS_WRITING lease.pml   must FAIL (the bug the keeper fixed)
 *   ... -DBUG_LOST_LEASE_KEEPS_WRITING -DWRITERS_ONLY  must FAIL: without the I5 checks
 *                                                      (which catch it first), two writers
 */

/* ------------------------------------------------------------------ bounds */
#define NE 2            /* executors (workers running execute_write) */
#define NA 2            /* actions, all on one target: a0 needs approval, a1 is auto-approved */
#ifndef ATTEMPTS
#define ATTEMPTS 1      /* execute_write activities each executor runs */
#endif
#ifndef MAXDB
#define MAXDB 2         /* database failures, over the whole run */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1      /* executor crashes */
#endif
#ifndef MAXFREEZE
#define MAXFREEZE 1     /* freezes of a worker inside its tool call (FROZEN_CALL only) */
#endif

/* The strict checks (mutual exclusion without the fence's help, nothing of a
 * reconciled action still running) hold unless a worker can freeze inside its
 * call; -DSTRICT keeps them on regardless. The ledger checks (nothing lands
 * after a reconciliation, the ledger tells the truth) hold always, thanks to
 * the reconciliation fence; -DNO_FENCE removes the fence (must then fail). */
#ifndef FROZEN_CALL
#define STRICT
#endif
#if defined(STRICT) || defined(FROZEN_CALL)
#define LEDGER
#endif

#define NONE 255

/* action status (roundtable/store/states.py ActionStatus) */
#define WAITING   0
#define APPROVED  1
#define REJECTED  2
#define EXECUTING 3
#define SUCCEEDED 4
#define FAILED    5
#define UNKNOWN   6

/* approval status (ApprovalStatus) */
#define AP_NONE      0  /* auto-approved: no approval row */
#define AP_PENDING   1
#define AP_APPROVED  2
#define AP_REJECTED  3
#define AP_EXPIRED   4
#define AP_WITHDRAWN 5

/* answers of a database step */
#define R_OK       0
#define R_CLAIMED  1
#define R_NOCLAIM  2  /* target_busy, in_progress, unknown, target_reconciliation_required,
                         not_approved, already_finished: the workflow reads the action */
#define R_DB_ERROR 3
#define R_SETTLE   4  /* the claim found its action executing: settle_claim */

/* where the tool call is */
#define CP_BEFORE 0   /* not yet at the tool */
#define CP_WINDOW 1   /* the tool accepted the start; the write is in flight */

/* ------------------------------------------------------------------ state */
/* the store: actions and approvals */
byte st[NA];          /* ActionRow.status */
byte ap[NA];          /* ApprovalRow.status */
bit  due[NA];         /* the approval's deadline has passed by the database clock */
byte dl[NA];          /* the approval's deadline, as a version: each extension adds one */
byte ap_changes[NA];  /* ghost: times the approval left pending */
byte tok[NA];         /* ActionRow.fencing_token */
byte attempts[NA];    /* ActionRow.attempt_count */
bit  reported[NA];    /* result.attempt_reported */
bit  run_closed;      /* the run's workflow closed; the sweep settled the run */

/* the store: the one target's lease row (ActionLeaseRow) and fencing counter */
byte lease_act = NONE; /* action_id of the row, NONE when there is no row */
byte lease_tok;        /* fencing_token of the row */
bit  lease_live;       /* lease_expires_at > now */
byte last_tok;         /* TargetFencingRow.last_token */

/* the tool: the demo ticket system, one ticket = the target */
byte highest;          /* TicketRow.highest_fencing_token */
bit  win[NE];          /* executor e's write is in flight: started, not yet applied,
                          refused or abandoned (its TicketWriteRow says "started") */
byte wtok[NE];         /* the token that write carries */
byte applied[NA];      /* writes of each action the ticket system applied */

/* the workers */
bit  calling[NE];      /* executor e's tool call is running (call_under_lease) */
byte cact[NE];         /* ... for this action */
bit  guard[NE];        /* e's keeper holds the lease, so it cannot lapse while e runs */
bit  frozen[NE];       /* e's process is frozen (no step, no hold) */

/* ghosts for the checks */
bit  crashed_att[NA];  /* the attempt that claimed the action died before recording */
bit  recorded[NA];     /* the attempt recorded a definite result */
bit  reconciled[NA];

/* fault budgets */
byte dbfails;
byte crashes;
byte freezes;
byte executors_done;

/* A database step that fails, while the budget lasts. */
#define DB_FAILS (dbfails < MAXDB) -> dbfails++
/* A crash of this executor, while the budget lasts. */
#define CRASH (crashes < MAXCRASH) -> crashes++; goto crashed

/* The lease cannot lapse while the keeper of the attempt holding it runs:
 * holds succeed (the lease is extended), or they fail and the keeper, whose
 * deadline falls one interval before the database's, cancels the call, which
 * ends before the lease lapses (assumption A1 in the README). A frozen worker
 * holds nothing. */
#define KEPT(e) (guard[e] && cact[e] == lease_act && !frozen[e])
#define LEASE_KEPT (KEPT(0) || KEPT(1))

/* The call may take its next step: always in the old code (nothing stopped
 * it); once cancelled, only the step that was under way (to_completion). */
#ifdef BUG_LOST_LEASE_KEEPS_WRITING
#define CALL_GOES_ON (true)
#else
#define CALL_GOES_ON (!lost || grace)
#endif

/* The lease row is this attempt's and has not run out (_extend_lease's WHERE). */
#define HELD(a, t) (lease_act == a && lease_tok == t && lease_live)

inline delete_lease(a) {
  if
  :: lease_act == a -> lease_act = NONE; lease_live = 0
  :: else -> skip
  fi
}

/* ExecutionOps._mark_unknown: executing -> unknown, the lease row stays. */
inline mark_unknown(a) {
  if
  :: st[a] == EXECUTING -> st[a] = UNKNOWN; printf("MSC: a%d becomes unknown\n", a)
  :: else -> skip
  fi
}

/* ExecutionOps._end_attempt: stop the lease's clock; the row stays. */
inline end_attempt(a) {
  if
  :: lease_act == a && lease_tok == tok[a] && lease_live -> lease_live = 0
  :: else -> skip
  fi
}

/* ApprovalOps._expire_locked */
inline expire_locked(a) {
  if
  :: ap[a] == AP_PENDING ->
       ap[a] = AP_EXPIRED; ap_changes[a]++;
       if :: st[a] == WAITING -> st[a] = REJECTED :: else -> skip fi
  :: else -> skip
  fi
}

/* ApprovalOps.withdraw_action */
inline withdraw(a) {
  if
  :: st[a] == WAITING ->
       if :: ap[a] == AP_PENDING -> ap[a] = AP_WITHDRAWN; ap_changes[a]++ :: else -> skip fi;
       st[a] = REJECTED
  :: st[a] == APPROVED -> st[a] = REJECTED
  :: else -> skip
  fi
}

/* ExecutionOps.reconcile_action, by an operator who looks at the ticket (truthfully). */
inline reconcile(a) {
  if
  :: st[a] == UNKNOWN && lease_act == a && lease_live ->
       skip   /* AttemptMayBeRunningError: try again once the lease has run out */
  :: st[a] == UNKNOWN && !(lease_act == a && lease_live) ->
       printf("MSC: operator reconciles a%d (the ticket was written: %d)\n", a, applied[a]);
#if defined(STRICT) && !defined(WRITERS_ONLY)
       /* I5: nothing of the action can still write */
       assert(!(calling[0] && cact[0] == a) && !(calling[1] && cact[1] == a));
#endif
#ifndef NO_FENCE
       /* write_activities._fence_target / TicketSystem.fence: "failed" is
        * written only after the tool refuses this attempt's token */
       if
       :: applied[a] == 0 && highest < tok[a] + 1 -> highest = tok[a] + 1
       :: else -> skip
       fi;
#endif
       st[a] = (applied[a] > 0 -> SUCCEEDED : FAILED);
       reconciled[a] = 1;
       delete_lease(a);
       /* I5: after reconciliation the target is free */
       assert(lease_act == NONE)
  :: else -> skip   /* ConflictError: only unknown actions reconcile */
  fi
}

/* ------------------------------------------------------------------ executors */

/* write_activities.execute_write (claim, call_under_lease, record), then, when
 * the activity fails, the workflow's settle_write (RoundtableWorkflow._attempt). */
proctype Executor(byte e) {
  byte a = NONE;   /* the action of this attempt */
  byte mine;       /* its fencing token, once claimed */
  byte out;        /* what the attempt will record */
  byte res;        /* a database step's answer */
  byte phase;      /* where the tool call is */
  byte n;          /* attempts so far */
  bit lost;        /* the keeper said the lease may be lost: the call is cancelled */
  bit grace;       /* ... but the step under way when that was said may still complete */
  bit dead;        /* this worker crashed */

next:
  atomic {
    /* a new attempt (the workflow retries an unclaimed write), or none */
    a = NONE; mine = 0; out = NONE; res = R_OK; phase = CP_BEFORE; lost = 0; grace = 0;
    cact[e] = NONE;
    if
    :: n < ATTEMPTS -> n++;
       if :: a = 0 :: a = 1 fi
    :: true -> goto done
    fi
  }

claim:  /* Leases.claim (store.claim_action_for_execution), one transaction; an
          action found executing is settled by settle_claim, in another */
  atomic {
    if
    :: DB_FAILS; res = R_DB_ERROR
    :: true ->
       res = R_NOCLAIM;
       if
       :: st[a] == EXECUTING -> res = R_SETTLE            /* settled in settle_claim */
       :: st[a] == APPROVED ->
            if
            :: (st[0] == UNKNOWN || st[1] == UNKNOWN) -> skip   /* _facts_query: blocked_by_unknown */
            :: else ->
                 if
                 :: lease_act != NONE -> skip             /* key taken: PG ON CONFLICT DO NOTHING; SQLite the read's key_held */
                 :: else ->
                      last_tok++;                         /* _next_fencing_token */
                      lease_act = a; lease_tok = last_tok; lease_live = 1;
                      tok[a] = last_tok; st[a] = EXECUTING; attempts[a]++;
                      assert(attempts[a] == 1);           /* I2: claimed at most once */
                      assert(ap[a] == AP_NONE || ap[a] == AP_APPROVED);
                      mine = last_tok; cact[e] = a;
                      printf("MSC: e%d claims a%d, token %d\n", e, a, mine);
                      res = R_CLAIMED
                 fi
            fi
       :: else -> skip      /* waiting_approval, unknown, or final */
       fi
    fi;
    if
    :: res == R_DB_ERROR -> res = R_OK; goto settle
    :: res == R_NOCLAIM -> goto next
    :: res == R_SETTLE -> res = R_OK; goto settle_claim
    :: res == R_CLAIMED -> res = R_OK
    fi
  };
  goto first_hold;

settle_claim:  /* Leases._settle_executing: the claim found its action executing
                  and wrote nothing; a transaction of its own re-reads it */
  atomic {
    if
    :: CRASH                                              /* died between the two */
    :: DB_FAILS; goto settle
    :: true ->
       if
       :: st[a] == EXECUTING ->                           /* _claim_own_executing */
            if
            :: lease_act == a && lease_live -> skip       /* in_progress */
            :: else -> mark_unknown(a)                    /* unknown */
            fi
       :: else -> skip         /* ended in between: already_finished / unknown */
       fi;
       goto next
    fi
  }

first_hold:  /* store.get_action and arguments, then call_under_lease's first
                keeper.hold_once (store.hold_action_lease) before invoking */
  atomic {
    if
    :: CRASH                                              /* died since the claim */
    :: DB_FAILS; goto settle                              /* reading the action failed */
    :: DB_FAILS; out = FAILED; goto record                /* lease_not_held_at_start */
    :: true ->
       if
       :: (st[a] == EXECUTING || st[a] == UNKNOWN) && HELD(a, mine) ->
            if
            :: st[a] == EXECUTING -> calling[e] = 1; guard[e] = 1   /* held: invoke */
            :: else -> out = FAILED; goto record          /* held, but not executing */
            fi
       :: else -> out = FAILED; goto record               /* lease_not_held_at_start */
       fi
    fi
  }

call:  /* the tool call beside its keeper (call_under_lease, _Keeper.keep, _wind_down) */
  do
  :: !lost ->
keeper_lost:  /* a hold refused, failing or too slow, or the action no longer executing */
       lost = 1; grace = 1;
       printf("MSC: e%d's keeper: lease of a%d in doubt\n", e, a);
#if defined(BUG_LOST_LEASE_KEEPS_WRITING) || defined(BUG_KEEPER_LETS_GO_AT_CANCEL)
       guard[e] = 0     /* the old code: renewals fail or stop, the lease lapses under the call */
#endif
  :: phase == CP_BEFORE && CALL_GOES_ON ->
tool_start:  /* TicketSystem._start: the fence */
       atomic {
         grace = 0;
         if
         :: mine < highest -> out = FAILED;               /* stale_fencing_token */
              printf("MSC: ticket refuses e%d's start (token %d < %d)\n", e, mine, highest);
              break
         :: else ->
              highest = mine; win[e] = 1; wtok[e] = mine; phase = CP_WINDOW;
              printf("MSC: ticket starts e%d's write of a%d (token %d)\n", e, a, mine);
#ifdef STRICT
              assert(!win[1 - e]);                           /* I1: one writer at a time */
#endif
              assert(!win[1 - e] || wtok[1 - e] < mine)      /* I1 (fenced) */
         fi
       }
  :: phase == CP_WINDOW && CALL_GOES_ON ->
tool_finish:  /* TicketSystem._finish: the fence again, then the write applies */
       atomic {
         grace = 0; win[e] = 0; wtok[e] = 0;
         if
         :: mine < highest -> out = FAILED;               /* stale_fencing_token */
              printf("MSC: ticket refuses e%d's write (token %d < %d)\n", e, mine, highest)
         :: else ->
              applied[a]++;
              printf("MSC: ticket applies e%d's write of a%d (token %d)\n", e, a, mine);
              assert(applied[a] == 1);                     /* I2: nothing applied twice */
              assert(!win[1 - e] || wtok[1 - e] < mine);   /* I1 (fenced): no live rival */
#if defined(LEDGER) && !defined(WRITERS_ONLY)
              assert(!reconciled[a]);                      /* I5: nothing lands after reconciliation */
#endif
              if
              :: out = SUCCEEDED
              :: out = UNKNOWN     /* the answer was lost after the write (a tool_error) */
              fi
         fi;
         break
       }
#ifndef BUG_LOST_LEASE_KEEPS_WRITING
  :: lost && phase == CP_BEFORE -> break                    /* cancelled before the tool */
  :: lost && phase == CP_WINDOW ->
abandon:  /* cancelled in flight: TicketSystem._close_log(abandoned), nothing written */
       win[e] = 0; wtok[e] = 0;
       printf("MSC: e%d's write of a%d abandoned\n", e, a);
       break
#endif
#ifdef FROZEN_CALL
  :: freezes < MAXFREEZE ->
freeze:  /* the whole process stops past its lease: no hold, no step */
       freezes++; frozen[e] = 1;
       printf("MSC: e%d freezes\n", e);
       frozen[e] = 0;
       printf("MSC: e%d wakes\n", e)
#endif
  :: CRASH
  od;

call_ended:  /* the keeper holds until the call has ended, then stops (keeper.stop) */
  atomic {
    calling[e] = 0; guard[e] = 0; phase = CP_BEFORE; grace = 0;
    if
    :: lost -> out = UNKNOWN; lost = 0     /* CallOutcome.stopped: lease_lost */
    :: else -> skip
    fi
  }

record:  /* ExecutionOps.record_action_terminal_result(fencing_token, attempt_over=True) */
  atomic {
    if
    :: CRASH                                   /* died before recording */
    :: DB_FAILS; goto settle
    :: true ->
       if
       :: tok[a] == mine && st[a] == UNKNOWN ->
            reported[a] = 1;                  /* _attempt_reported */
            end_attempt(a)                    /* attempt_over: _end_attempt */
       :: tok[a] == mine && st[a] == EXECUTING ->
            /* I3: a definite result comes from the attempt itself, and says what the tool did */
            assert(!crashed_att[a]);
            assert(out != SUCCEEDED || applied[a] == 1);
            assert(out != FAILED || applied[a] == 0);
            st[a] = out;
            printf("MSC: e%d records a%d: %d\n", e, a, out);
            if
            :: out != UNKNOWN -> recorded[a] = 1; delete_lease(a)
            :: else -> end_attempt(a)
            fi
       :: else -> skip                        /* settled meanwhile (or another token): False */
       fi;
       goto next
    fi
  }

crashed:  /* the worker dies; its in-process call dies with it */
  atomic {
    dead = 1;
    printf("MSC: e%d crashes\n", e);
    win[e] = 0; wtok[e] = 0; calling[e] = 0; guard[e] = 0;
    if
    :: mine != 0 && tok[a] == mine && st[a] == EXECUTING -> crashed_att[a] = 1
    :: else -> skip
    fi;
    mine = 0; out = NONE; phase = CP_BEFORE; lost = 0; grace = 0
  }

settle:  /* the activity failed: the workflow's settle_write (a local activity, retried) */
  if
  :: true -> skip     /* the workflow is gone too: the sweep settles the closed run */
  :: true ->
       do
       :: DB_FAILS      /* retried */
       :: atomic { mark_unknown(a); break }    /* executing -> unknown, no attempt_over */
       od
  fi;
  if
  :: dead -> goto done
  :: else -> goto next
  fi;

done:
  atomic { a = NONE; cact[e] = NONE; executors_done++ }
}

/* ------------------------------------------------------------------ people and time */

/* ApprovalOps.decide_approval, one transaction: a decision past the deadline
 * (database clock) expires the approval instead (ConflictError). */
inline decide_approval(a, decision) {
  if
  :: ap[a] != AP_PENDING -> skip                  /* ConflictError: already decided */
  :: ap[a] == AP_PENDING && due[a] -> expire_locked(a)
  :: ap[a] == AP_PENDING && !due[a] ->
       ap[a] = decision; ap_changes[a]++;         /* _apply_decision */
       if
       :: st[a] == WAITING -> st[a] = (decision == AP_APPROVED -> APPROVED : REJECTED)
       :: else -> skip
       fi
  fi
}

/* ApprovalOps.extend_approval: only a pending approval not yet past its deadline. */
inline extend_approval(a) {
  if
  :: ap[a] == AP_PENDING && !due[a] -> dl[a]++
  :: else -> skip                                 /* ConflictError */
  fi
}

/* ApprovalOps.expire_approval(deadline=armed): the workflow's timer is
 * authoritative, unless an extension moved the deadline past the armed one. */
inline expire_approval(a, armed) {
  if
  :: dl[a] > armed -> skip                        /* False: extended first, re-arm */
  :: else -> expire_locked(a)
  fi
}

/* ApprovalOps.expire_due_approvals: pending approvals past their deadline. */
inline expire_due_approvals(a) {
  if
  :: ap[a] == AP_PENDING && due[a] -> expire_locked(a)
  :: else -> skip
  fi
}

/* ExecutionOps.recover_expired_action_leases: executing with a lapsed lease -> unknown. */
inline recover_expired_action_leases() {
  if
  :: lease_act != NONE && !lease_live -> mark_unknown(lease_act)
  :: else -> skip
  fi
}

/* ExecutionOps.settle_closed_run, for one action (one transaction each):
 * executing -> unknown (its lease keeps running); unclaimed -> withdrawn. */
inline settle_closed_action(a) {
  if
  :: st[a] == EXECUTING -> mark_unknown(a)
  :: else -> withdraw(a)
  fi
}

/* An operator: decides a0's approval, extends it (once), reconciles unknown actions. */
proctype Operator() {
end:
  do
  :: atomic { ap[0] == AP_PENDING -> decide_approval(0, AP_APPROVED) }
  :: atomic { ap[0] == AP_PENDING -> decide_approval(0, AP_REJECTED) }
  :: atomic { ap[0] == AP_PENDING && dl[0] == 0 -> extend_approval(0) }
  :: atomic { st[0] == UNKNOWN -> reconcile(0) }
  :: atomic { st[1] == UNKNOWN -> reconcile(1) }
  od
}

/* The run's workflow waiting on a0's decision (RoundtableWorkflow._await_decision,
 * _expire): its timer, armed for the deadline it knows, fires and expires. */
proctype ApprovalTimer() {
  byte armed;   /* the deadline the timer was armed for */
end:
  do
  :: atomic {
       ap[0] == AP_PENDING ->
       expire_approval(0, armed);
       armed = (ap[0] == AP_PENDING -> dl[0] : 0)   /* re-armed for the new deadline */
     }
  od
}

/* The sweep (SweepWorkflow -> SweepActivities.sweep_store, check_runs). */
proctype Sweeper() {
end:
  do
  :: atomic { ap[0] == AP_PENDING && due[0] -> expire_due_approvals(0) }
  :: atomic { lease_act != NONE && !lease_live && st[lease_act] == EXECUTING ->
              recover_expired_action_leases() }
  :: !run_closed ->             /* the run's workflow closed: settle_closed_run */
close_run:
       run_closed = 1;
       atomic { settle_closed_action(0) };
       atomic { settle_closed_action(1) }
  od
}

/* Time, abstractly: the approval's deadline passes (database clock); the lease
 * runs out, unless the keeper of the attempt holding it is running. */
proctype Clock() {
end:
  do
  :: atomic { ap[0] == AP_PENDING && !due[0] -> due[0] = 1 }
  :: atomic { lease_act != NONE && lease_live && !LEASE_KEPT ->
              lease_live = 0; printf("MSC: the lease of a%d runs out\n", lease_act) }
  od
}

init {
  atomic {
    st[0] = WAITING;  ap[0] = AP_PENDING;
    st[1] = APPROVED; ap[1] = AP_NONE;
    cact[0] = NONE; cact[1] = NONE;
    run Executor(0); run Executor(1);
    run Operator(); run ApprovalTimer(); run Sweeper(); run Clock()
  }
  executors_done == NE;
quiescent:  /* everyone has stopped: time passes, every lease runs out, the sweep recovers */
  d_step {
    lease_live = 0;
    mark_unknown(0); mark_unknown(1);
  }
  /* I4: every crash ends unknown (or reconciled); nothing stays executing */
  assert(st[0] != EXECUTING && st[1] != EXECUTING);
  assert(!crashed_att[0] || st[0] == UNKNOWN || reconciled[0]);
  assert(!crashed_att[1] || st[1] == UNKNOWN || reconciled[1]);
  /* I3: succeeded only on its attempt's record or a reconciliation */
  assert(st[0] != SUCCEEDED || recorded[0] || reconciled[0]);
  assert(st[1] != SUCCEEDED || recorded[1] || reconciled[1]);
  /* approvals: decided, expired or withdrawn at most once */
  assert(ap_changes[0] <= 1 && ap_changes[1] == 0);
  /* an operator reconciles every unknown action (allowed now: no attempt is alive) */
  d_step { reconcile(0); reconcile(1) }
  /* I5: after reconciliation the target is free */
  assert(lease_act == NONE && st[0] != UNKNOWN && st[1] != UNKNOWN);
#ifdef LEDGER
  /* the ledger tells the truth: succeeded exactly when the ticket was written */
  assert((st[0] == SUCCEEDED) == (applied[0] == 1));
  assert((st[1] == SUCCEEDED) == (applied[1] == 1))
#endif
}
