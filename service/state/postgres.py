"""The shared state store of scheduler replicas: one PostgreSQL database (docs/replicas.md).

The database is the source of truth. Each replica's core holds only the sequences it
owns (`sequences.owner` is its replica_id): those it claimed from the shared queue and
those assigned to its workers. Ownership moves only inside a transaction that locks the
rows, and every save of a replica first locks the rows it touches and checks that it
still owns them (`Disowned` otherwise), so two replicas never both write one sequence.

- Submit (any replica): `lattice_submit()`, one statement and one synchronous commit:
  request_id idempotency per principal (a unique index on both), the queue limits, a new
  seq_id and tail key from database sequences, the queue position. No NOTIFY: every
  replica's watcher finds new seq_ids in its reading (`watch`). Requeues (a hand-back, a
  leave, a dead replica's sequences) NOTIFY lattice_submit.
- Claim: the replica's prefetcher takes the head of the unclaimed queue in the queue
  order's sort key (service/core/decide/orders.py) with FOR UPDATE SKIP LOCKED, of the sequences
  its workers can run (no adapter, or one of theirs): an adapter's sequence waits in the
  shared queue for a replica with a worker that has it, and says so (`unservable_queued`,
  `sequence_info`) while no live worker anywhere has it.
- Leases: a replica renews its row in `replicas`; a live replica returns the sequences
  of replicas whose lease ran out to the shared queue (`reclaim_expired`).
- Saves: group commit (service/state/pg_commit.py): the saves collected on a replica go
  in one transaction, checked against the replica's fence (`replicas.fence`) instead of
  row by row while ownership is as last seen.
- Tokens: one `token_log` row per commit holding all its appends (token_log.py); a
  sequence's row says how many tokens are saved (`num_saved`) and where they are: its
  folded head (`output_head`), then the log rows of `log_replica` from `log_from` on.
  A commit notifies no one: PostgreSQL wakes every listening backend at each NOTIFY, so
  one per commit would cost every replica CPU at every other replica's commit. A stream
  of another replica's sequence follows the replicas' commit numbers instead
  (`watch`, read every --replica-watch-ms by each replica's watcher); what changes
  a sequence outside its owner's commits (a cancel of an unclaimed one, a keeper's
  cancel, a hand-back) still NOTIFYs lattice_progress with its ids; a claim does not
  (its sequences' streams elsewhere find the new owner in the watcher's reading of the
  ids they wait on). The keepers fold
  the tokens of sequences whose log rows fall too far behind into their heads, then
  delete the log rows no sequence points at (`collect_token_log`: the retention bound).
- Retries: each commit carries a number recorded on the replica's row in the same
  transaction (`replicas.last_commit`); a commit whose outcome was unknown is retried
  under its number, and if the first attempt did commit, the retry applies nothing.
  While the replica's row is gone (its lease ran out) nothing commits: the number could
  not be recorded.
- Cancel of a sequence another replica owns: `cancel_requested` is set and committed,
  then NOTIFY lattice_cancel tells the owner, which cancels it in its core.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from service.core import SEES_ALL, Caller, ConfigError, FinishReason, SequenceState, SubmitParams
from service.core.decide.orders import ArrivalOrder, QueueOrder, SortTerm
from service.core.errors import InvalidArgument, NotFound, QueueFull
from service.core.persist.homes import finished_key, prompt_keys
from service.core.persist.store import (
    Disowned,
    SequenceProgress,
    StateChanges,
    StoredSequence,
    StoredState,
    StoreError,
)
from service.core.tables.ledger import no_worker_has
from service.core.types import SequenceInfo, SubmitResult
from service.state.pg_batch import SaveBatch
from service.state.pg_owned import OwnedSet
from service.state.rows import (
    pack_token_ids,
    params_from_row,
    params_json,
    registration_json,
    unpack_token_ids,
)
from service.state.token_log import Outputs, pack_entries, unpack_entries

log = logging.getLogger(__name__)

# 2: sequences.principal, request_id unique per principal, sequences.adapter_id.
# 3: replicas.fence (group commit checks ownership once per commit, not per row).
# 4: commit numbers (replicas.last_commit); token counts and heads on sequences
#    (num_saved, output_head, log_replica, log_from); token_log by (replica_id, id).
# 5: replica_counts (every running sequence's count in one row per replica).
# 6: no commit or submit NOTIFYs (each replica's watcher reads commit numbers and the
#    newest seq_id instead); the tables are version 5's.
SCHEMA_VERSION = 7
SUBMIT_CHANNEL = "lattice_submit"
PROGRESS_CHANNEL = "lattice_progress"
CANCEL_CHANNEL = "lattice_cancel"
DISOWN_CHANNEL = "lattice_disown"  # "owner:ids": another replica took these over
_MAX_NOTIFY_PAYLOAD = 7900  # PostgreSQL's limit is 8000 bytes
_QUEUED, _FINISHED = SequenceState.QUEUED.value, SequenceState.FINISHED.value
_ASSIGNED = (SequenceState.PREFILLING.value, SequenceState.DECODING.value)
# What lattice_disowned() raises: a commit touched a sequence this replica no longer owns.
_DISOWNED_SQLSTATE = "LT001"
# What lattice_commit() raises: this commit's number is recorded, an earlier attempt of it
# committed (its outcome was unknown to this replica).
_DONE_SQLSTATE = "LT002"
# A commit's number (and fence check) as one plain UPDATE: lattice_commit(), a PL/pgSQL
# call that costs PostgreSQL more than the update itself, runs only when it matched no row,
# to say why: LT002, LT001, or LT003 when the replica's row is gone (its lease ran out; a
# StoreError, and the batch is retried under its number once renew_lease wrote the row).
_RECORD_COMMIT = (
    "WITH u AS (UPDATE replicas SET last_commit = %(no)s WHERE replica_id = %(me)s "
    "AND last_commit < %(no)s AND (%(fence)s::bigint IS NULL OR fence = %(fence)s) "
    "RETURNING 1) SELECT lattice_commit(%(me)s, %(fence)s, %(no)s) "
    "WHERE NOT EXISTS (SELECT 1 FROM u)"
)
# The keepers fold the tokens of a sequence whose first unfolded log row is more than this
# many rows behind the newest into its head, so log rows older than that can go.
FOLD_ROWS_BEHIND = 2000
# A replica's counts row (replica_counts: where the saved output of each sequence it
# appends to ends) is written by one commit in this many of those that append, so that a
# GetSequence of a running sequence reads at most this many - 1 log rows past it.
COUNT_EVERY_COMMITS = 16
# Finished sequences of replicas that are gone whose owner a keeper round takes off, at
# most (reclaim_expired): the rest in the rounds after.
FINISHED_OWNERS_A_ROUND = 2_000
# A sequence's own row is written by a commit that only appends to it (a steady decode
# step) when it has no log rows yet and once its count lags this many tokens: row updates
# are what a commit costs PostgreSQL (bench/pg_commit_cost.py), and the counts row bounds
# the reads in its stead (16 before it existed: two row updates a decision).
COUNT_EVERY_TOKENS = 256

_SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS lattice_seq_ids;
CREATE SEQUENCE IF NOT EXISTS lattice_queue_tail;   -- tail keys: 1, 2, ...
CREATE SEQUENCE IF NOT EXISTS lattice_queue_head;   -- head keys: -1, -2, ... (negated)
CREATE SEQUENCE IF NOT EXISTS lattice_replica_ids;
CREATE SEQUENCE IF NOT EXISTS lattice_incarnations; -- worker registrations, all replicas
CREATE SEQUENCE IF NOT EXISTS lattice_fences;       -- replicas.fence values, never reused
CREATE TABLE IF NOT EXISTS lattice_meta (key text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS replicas (
    replica_id  bigint PRIMARY KEY,
    name        text NOT NULL,          -- host:port: where other replicas reach it
    started_at  timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL,   -- renewed while it lives
    -- A new value whenever another replica takes sequences this one owned (or the row is
    -- written again after its lease ran out): a commit that finds the value it last saw,
    -- with its row locked, owns every sequence it held then (lattice_commit()).
    fence       bigint NOT NULL DEFAULT nextval('lattice_fences'),
    -- The number of its last commit (each commit's is higher): a retried commit whose
    -- number is here already committed, and applies nothing (lattice_commit()).
    last_commit bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS sequences (
    seq_id      bigint PRIMARY KEY,
    request_id  text,                   -- NULL when the client sent none
    principal   text NOT NULL DEFAULT '',  -- who submitted it ('' without tokens)
    adapter_id  text NOT NULL DEFAULT '',  -- its LoRA adapter ('' for the base model)
    params      text NOT NULL,          -- JSON: everything submitted but the prompt
    prompt      bytea NOT NULL,         -- uint32 little-endian token ids
    priority    integer NOT NULL,
    tenant      text NOT NULL,
    max_new_tokens integer NOT NULL,
    submitted_at double precision NOT NULL, -- epoch seconds (database clock)
    state       smallint NOT NULL,      -- SequenceState
    owner       bigint,                 -- replica_id; NULL: unclaimed (or finished)
    worker_id   text,
    queue_key   bigint,                 -- ascending = FCFS order; NULL when not queued
    cursor      integer NOT NULL DEFAULT 0,
    prefilled_tokens integer NOT NULL DEFAULT 0,
    num_generated    integer NOT NULL DEFAULT 0,
    num_generated_at_admission integer NOT NULL DEFAULT 0,
    finish_reason    smallint,
    finish_order     bigint NOT NULL DEFAULT 0,
    admission_order  bigint NOT NULL DEFAULT 0,
    error_message    text NOT NULL DEFAULT '',  -- why it failed, for FAILED
    cancel_requested boolean NOT NULL DEFAULT false,
    home        bigint,                 -- replica where its prefix is cached (claims prefer)
    -- Its saved output: the first octet_length(output_head) / 4 tokens folded here, the
    -- rest in token_log rows of log_replica with id >= log_from. num_saved counts them
    -- through log row counted_log (the appends of later rows are not counted here yet:
    -- a steady step writes no sequence row, one in COUNT_EVERY_TOKENS does).
    num_saved   integer NOT NULL DEFAULT 0,
    counted_log bigint,
    output_head bytea NOT NULL DEFAULT '',
    log_replica bigint,
    log_from    bigint
);
-- Progress updates change no indexed column (HOT updates): room on the page for them.
ALTER TABLE sequences SET (fillfactor = 70);
CREATE UNIQUE INDEX IF NOT EXISTS sequences_request ON sequences (principal, request_id);
CREATE INDEX IF NOT EXISTS sequences_unclaimed ON sequences (queue_key, seq_id)
    WHERE state = 1 AND owner IS NULL;
CREATE INDEX IF NOT EXISTS sequences_queued ON sequences (queue_key, seq_id)
    WHERE state = 1;
CREATE INDEX IF NOT EXISTS sequences_owner ON sequences (owner) WHERE owner IS NOT NULL;
CREATE INDEX IF NOT EXISTS sequences_worker ON sequences (worker_id)
    WHERE worker_id IS NOT NULL;
-- Queued sequences with an adapter (few), for the fleet-wide unservable count.
CREATE INDEX IF NOT EXISTS sequences_adapter_queued ON sequences (adapter_id)
    WHERE state = 1 AND adapter_id <> '';
CREATE TABLE IF NOT EXISTS tokens (
    seq_id    bigint NOT NULL,
    start     integer NOT NULL,         -- index of the first token in the output
    token_ids bytea NOT NULL,           -- uint32 little-endian
    PRIMARY KEY (seq_id, start)
);
-- One row per group commit holding all its appends (token_log.py); a sequence's rows are
-- found through its own row (log_replica, log_from), so one index key per commit.
CREATE TABLE IF NOT EXISTS token_log (
    id      bigserial PRIMARY KEY,      -- rises in commit order for any one sequence
    replica_id bigint NOT NULL,         -- the replica that committed it
    entries bytea NOT NULL              -- (seq_id int64, start int32, n int32, n x uint32)
);
CREATE INDEX IF NOT EXISTS token_log_replica ON token_log (replica_id, id);
-- A commit's row stays in its page uncompressed up to 8 KB: compressing it (pglz, past
-- 2 KB by default) cost PostgreSQL more CPU than the rest of the insert; larger rows take
-- lz4 where the server has it (bench/pg_commit_cost.py).
ALTER TABLE token_log SET (toast_tuple_target = 8160);
DO $$ BEGIN
    ALTER TABLE token_log ALTER COLUMN entries SET COMPRESSION lz4;
EXCEPTION WHEN OTHERS THEN NULL;  -- before PostgreSQL 14, or built without lz4
END $$;
-- Where the saved output of each sequence a replica appends to ends, through its log row
-- through_log: one row per replica, written by one commit in COUNT_EVERY_COMMITS, so
-- GetSequence reads a running sequence's log rows after it, not after its own row's
-- count (which a steady step leaves alone).
CREATE TABLE IF NOT EXISTS replica_counts (
    replica_id  bigint PRIMARY KEY,
    through_log bigint NOT NULL,
    seq_ids     bigint[] NOT NULL,
    ends        integer[] NOT NULL      -- ends[i]: saved tokens of seq_ids[i]
);
ALTER TABLE replica_counts SET (toast_tuple_target = 8160);
-- The oldest log row a sequence still needs bounds which rows may go.
CREATE INDEX IF NOT EXISTS sequences_log_from ON sequences (log_from)
    WHERE log_from IS NOT NULL;
CREATE TABLE IF NOT EXISTS workers (
    worker_id    text PRIMARY KEY,
    replica_id   bigint NOT NULL,
    registration text NOT NULL,
    drain_requested boolean NOT NULL DEFAULT false
);
-- The replica where a conversation's text was last finished (its workers' caches hold
-- it), by prefix key (service/core/persist/homes.py); pruned after an hour.
CREATE TABLE IF NOT EXISTS prefix_homes (
    prefix_key bigint PRIMARY KEY,
    replica_id bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS prefix_homes_age ON prefix_homes (updated_at);
CREATE TABLE IF NOT EXISTS tenant_service (
    tenant text PRIMARY KEY,
    served double precision NOT NULL    -- weighted tokens served, all replicas together
);
"""

# The functions, created again by every replica at start (CREATE OR REPLACE takes no table
# lock); the tables and indexes above only where the schema is created or migrated: their
# ALTER TABLE and CREATE INDEX lock tables every commit writes, and a replica starting
# beside running ones stalled their commits (and could deadlock with them).
_FUNCTIONS = """
-- The queue's size (sequences in state 1), kept by the transactions that queue or unqueue
-- a sequence (triggers on sequences, _QUEUE_COUNTING): each adds to the row of its own
-- server process, so no two transactions wait on one row (or deadlock over it).
CREATE OR REPLACE FUNCTION lattice_count_queued() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_delta integer := 0;
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.state = 1 THEN v_delta := v_delta - 1; END IF;
    IF TG_OP <> 'DELETE' AND NEW.state = 1 THEN v_delta := v_delta + 1; END IF;
    IF v_delta <> 0 THEN
        INSERT INTO queue_counts (backend, queued) VALUES (pg_backend_pid(), v_delta)
        ON CONFLICT (backend) DO UPDATE SET queued = queue_counts.queued + excluded.queued;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION lattice_queue_emptied() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM queue_counts;
    INSERT INTO queue_counts VALUES (0, 0);
    RETURN NULL;
END $$;
-- A group commit's checks (lattice_commit, below): the replica's fence is the one it last
-- saw (its row locked until the commit: no take-over commits meanwhile), else the whole
-- commit rolls back.
CREATE OR REPLACE FUNCTION lattice_disowned() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a sequence of this commit belongs to another replica now'
        USING ERRCODE = 'LT001';
END $$;
-- A commit's number recorded on its replica's row (locked until the commit: no take-over
-- commits meanwhile). LT002 when it is there already: an earlier attempt committed, roll
-- back. With p_fence, also the fence check (LT001 when it moved). A row deleted when its
-- lease ran out leaves its number in lattice_meta ('last_commit:<replica_id>',
-- reclaim_expired), checked while the row is gone and carried into the row written again
-- (renew_lease), so a retry after the lease ran out still finds an earlier attempt that
-- committed. Otherwise, while the row is gone (or was written again just after the UPDATE
-- looked), LT003: the number would be recorded nowhere and a retry would apply the commit
-- twice, so nothing commits until the row is back.
CREATE OR REPLACE FUNCTION lattice_commit(p_replica bigint, p_fence bigint, p_commit bigint)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_last bigint;
    v_fence bigint;
BEGIN
    UPDATE replicas SET last_commit = p_commit
     WHERE replica_id = p_replica AND last_commit < p_commit
       AND (p_fence IS NULL OR fence = p_fence);
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT last_commit, fence INTO v_last, v_fence FROM replicas WHERE replica_id = p_replica;
    IF NOT FOUND THEN  -- its lease ran out: the number its row held when it was deleted
        SELECT value INTO v_last FROM lattice_meta WHERE key = 'last_commit:' || p_replica;
    END IF;
    IF v_last >= p_commit THEN
        RAISE EXCEPTION 'commit % of replica % is recorded already', p_commit, p_replica
            USING ERRCODE = 'LT002';
    END IF;
    IF v_fence <> p_fence THEN  -- NULL (no fence to check, or no row): not disowned
        PERFORM lattice_disowned();
    END IF;
    RAISE EXCEPTION 'replica % has no row (its lease ran out): no commit until it renews',
        p_replica USING ERRCODE = 'LT003';
END $$;

-- A steady commit (appends only, ownership as last seen) as one statement run on its own
-- (autocommit: no BEGIN and COMMIT exchanges): the number and fence (lattice_commit()'s
-- errors when they fail), the log row, the counts row when p_counts_ids is not NULL, the
-- counts of p_counted_ids (as _SAVED_SET writes them), and a NOTIFY only when p_payload
-- is not NULL. The same rows, in the same order, as the commit's separate statements.
-- A replica passes NULL: no commit wakes the listeners (streams of other replicas follow
-- replicas.last_commit instead: watch); p_payload is always NULL since schema 6.
CREATE OR REPLACE FUNCTION lattice_append(
    p_replica bigint, p_fence bigint, p_commit bigint, p_sync boolean, p_entries bytea,
    p_counts_ids bigint[], p_counts_ends integer[], p_counted_ids bigint[],
    p_counted integer[], p_payload text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_log bigint;
    v_rows integer;
BEGIN
    IF p_sync THEN  -- acknowledged: the commit waits for the WAL flush
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    UPDATE replicas SET last_commit = p_commit
     WHERE replica_id = p_replica AND last_commit < p_commit AND fence = p_fence;
    IF NOT FOUND THEN
        PERFORM lattice_commit(p_replica, p_fence, p_commit);  -- LT002, LT001, LT003
    END IF;
    INSERT INTO token_log (replica_id, entries) VALUES (p_replica, p_entries)
    RETURNING id INTO v_log;
    IF p_counts_ids IS NOT NULL THEN
        INSERT INTO replica_counts (replica_id, through_log, seq_ids, ends)
        VALUES (p_replica, v_log, p_counts_ids, p_counts_ends)
        ON CONFLICT (replica_id) DO UPDATE SET through_log = excluded.through_log,
            seq_ids = excluded.seq_ids, ends = excluded.ends;
    END IF;
    IF cardinality(p_counted_ids) > 0 THEN
        UPDATE sequences s SET num_saved = v.saved, counted_log = v_log,
               log_replica = p_replica, log_from = coalesce(s.log_from, v_log)
          FROM unnest(p_counted_ids, p_counted) AS v(seq_id, saved)
         WHERE s.seq_id = v.seq_id AND s.owner = p_replica;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        IF v_rows <> cardinality(p_counted_ids) THEN
            PERFORM lattice_disowned();
        END IF;
    END IF;
    IF p_payload IS NOT NULL THEN
        PERFORM pg_notify('lattice_progress', p_payload);
    END IF;
END $$;

-- Submit in one statement: idempotency, limits, ids, position, home.
-- status: 0 new, 1 request_id known for this principal, 2 queue full, 3 tenant's queue full.
CREATE OR REPLACE FUNCTION lattice_enqueue(
    p_principal text, p_adapter_id text, p_request_id text, p_params text, p_prompt bytea, p_priority integer,
    p_tenant text, p_max_new_tokens integer, p_max_queue bigint, p_max_per_tenant bigint,
    p_sync boolean, p_prefix_keys bigint[],
    OUT status integer, OUT seq_id bigint, OUT queue_position bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_key bigint;
    v_home bigint;
BEGIN
    IF p_sync THEN  -- acknowledged: the commit waits for the WAL flush
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    IF p_request_id IS NOT NULL THEN
        SELECT s.seq_id INTO seq_id FROM sequences s
         WHERE s.request_id = p_request_id AND s.principal = p_principal;
        IF FOUND THEN
            status := 1;
            SELECT count(*) INTO queue_position FROM sequences q, sequences s
             WHERE s.seq_id = lattice_enqueue.seq_id AND s.state = 1 AND q.state = 1
               AND (q.queue_key, q.seq_id) < (s.queue_key, s.seq_id);
            queue_position := coalesce(queue_position, 0);
            RETURN;
        END IF;
    END IF;
    -- The queue's size (queue_counts: counting the queue read every queued sequence) is
    -- also the new sequence's position: every queued sequence holds a key ahead of a new
    -- tail key but those of concurrent submits that took a later key and committed first.
    SELECT coalesce(sum(c.queued), 0)::bigint INTO queue_position FROM queue_counts c;
    IF queue_position >= p_max_queue THEN
        status := 2; queue_position := NULL; RETURN;
    END IF;
    IF p_max_per_tenant > 0 AND (SELECT count(*) FROM sequences s
                                  WHERE s.state = 1 AND s.tenant = p_tenant)
                                >= p_max_per_tenant THEN
        status := 3; queue_position := NULL; RETURN;
    END IF;
    v_key := nextval('lattice_queue_tail');
    -- Its home: where the deepest of its prefixes was last finished (keys deepest first).
    SELECT h.replica_id INTO v_home
      FROM unnest(p_prefix_keys) WITH ORDINALITY AS k(prefix_key, depth)
      JOIN prefix_homes h ON h.prefix_key = k.prefix_key
     ORDER BY k.depth LIMIT 1;
    INSERT INTO sequences AS s (seq_id, request_id, principal, adapter_id, params, prompt,
                                priority, tenant, max_new_tokens, submitted_at, state,
                                queue_key, home)
    VALUES (nextval('lattice_seq_ids'), p_request_id, p_principal, p_adapter_id, p_params,
            p_prompt, p_priority, p_tenant, p_max_new_tokens,
            extract(epoch from clock_timestamp()), 1, v_key, v_home)
    ON CONFLICT (principal, request_id) DO NOTHING
    RETURNING s.seq_id INTO seq_id;
    IF NOT FOUND THEN  -- another replica took this request_id a moment ago
        SELECT s.seq_id INTO seq_id FROM sequences s
         WHERE s.request_id = p_request_id AND s.principal = p_principal;
        status := 1; queue_position := 0; RETURN;
    END IF;
    -- No NOTIFY: it would wake every replica's listener at every submit; replicas find
    -- new seq_ids in their watcher's reading (PostgresState.watch).
    status := 0;
END $$;
-- The same without prefix keys (schema 2's signature).
CREATE OR REPLACE FUNCTION lattice_submit(
    p_principal text, p_adapter_id text, p_request_id text, p_params text, p_prompt bytea, p_priority integer,
    p_tenant text, p_max_new_tokens integer, p_max_queue bigint, p_max_per_tenant bigint,
    p_sync boolean, OUT status integer, OUT seq_id bigint, OUT queue_position bigint)
LANGUAGE sql AS $$
    SELECT * FROM lattice_enqueue(p_principal, p_adapter_id, p_request_id, p_params, p_prompt,
        p_priority, p_tenant, p_max_new_tokens, p_max_queue, p_max_per_tenant, p_sync, '{}')
$$;
"""

# A database of schema version 1 becomes version 2 (run before _SCHEMA, which then adds
# the unique index per principal and the new lattice_submit): sequences saved before
# principals are the anonymous principal's ('', as without tokens).
_FROM_VERSION_1 = """
ALTER TABLE sequences ADD COLUMN principal text NOT NULL DEFAULT '';
ALTER TABLE sequences ADD COLUMN adapter_id text NOT NULL DEFAULT '';
UPDATE sequences SET adapter_id = coalesce(params::jsonb ->> 'adapter_id', '')
 WHERE state <> 4;
ALTER TABLE sequences DROP CONSTRAINT IF EXISTS sequences_request_id_key;
DROP FUNCTION IF EXISTS lattice_submit(text, text, bytea, integer, text, integer, bigint,
                                       bigint, boolean);
UPDATE lattice_meta SET value = 2 WHERE key = 'schema_version';
"""

# Version 2 becomes 3: every replica row gets a fence, sequences a home (lattice_enqueue
# takes prefix keys; lattice_submit becomes a call of it).
_FROM_VERSION_2 = """
CREATE SEQUENCE IF NOT EXISTS lattice_fences;
ALTER TABLE replicas ADD COLUMN IF NOT EXISTS fence bigint NOT NULL DEFAULT nextval('lattice_fences');
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS home bigint;
DROP FUNCTION IF EXISTS lattice_submit(text, text, text, text, bytea, integer, text, integer,
                                       bigint, bigint, boolean);  -- now over lattice_enqueue
UPDATE lattice_meta SET value = 3 WHERE key = 'schema_version';
"""

# Version 3 becomes 4 (with _fold_all_tokens between the two halves): commit numbers, the
# token counts and heads on sequence rows; the token log loses its GIN-indexed id arrays
# (every row is folded into its sequences' heads first) and gains the replica's id.
_FROM_VERSION_3 = """
-- A database that was version 2 (or 1) when this step began has no token log yet.
CREATE TABLE IF NOT EXISTS token_log (id bigserial PRIMARY KEY, entries bytea NOT NULL);
ALTER TABLE replicas ADD COLUMN IF NOT EXISTS last_commit bigint NOT NULL DEFAULT 0;
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS num_saved integer NOT NULL DEFAULT 0;
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS counted_log bigint;
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS output_head bytea NOT NULL DEFAULT '';
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS log_replica bigint;
ALTER TABLE sequences ADD COLUMN IF NOT EXISTS log_from bigint;
DROP INDEX IF EXISTS sequences_with_tokens;
DROP FUNCTION IF EXISTS lattice_fence(bigint, bigint);  -- now within lattice_commit()
"""
_FROM_VERSION_3_AFTER_FOLDING = """
DELETE FROM token_log;
DELETE FROM tokens;
ALTER TABLE token_log DROP COLUMN IF EXISTS seq_ids;
ALTER TABLE token_log DROP COLUMN IF EXISTS max_seq_id;
ALTER TABLE token_log ADD COLUMN IF NOT EXISTS replica_id bigint NOT NULL DEFAULT 0;
ALTER TABLE token_log ALTER COLUMN replica_id DROP DEFAULT;
UPDATE lattice_meta SET value = 4 WHERE key = 'schema_version';
"""

# Version 4 becomes 5: replica_counts (created by _SCHEMA, which runs next).
_FROM_VERSION_4 = """
UPDATE lattice_meta SET value = 5 WHERE key = 'schema_version';
"""

# Version 5 becomes 6: nothing in the tables. A version-5 replica waits for the commits'
# and submits' NOTIFYs (its streams would fall to a one-second poll, its prefetcher would
# not see other replicas' submits), and one starting later would put its notifying
# functions back for every replica: one version at a time.
_FROM_VERSION_5 = """
UPDATE lattice_meta SET value = 6 WHERE key = 'schema_version';
"""

# Version 6 becomes 7: an index of the queued sequences with an adapter, which the
# keepers' fleet-wide count reads instead of the whole table, and (_QUEUE_COUNTING, run
# next) the queue's kept size. A version-6 replica works beside both, so this runs while
# they do: it locks `sequences` against writes from the index's build to the end of the
# migration's transaction (the queue's count and the triggers included), and runs
# nothing else of _SCHEMA (whose ALTER TABLEs could deadlock with running commits).
_FROM_VERSION_6 = """
LOCK TABLE sequences IN SHARE ROW EXCLUSIVE MODE;  -- _QUEUE_COUNTING's, from the start
CREATE INDEX IF NOT EXISTS sequences_adapter_queued ON sequences (adapter_id)
    WHERE state = 1 AND adapter_id <> '';
UPDATE lattice_meta SET value = 7 WHERE key = 'schema_version';
"""

# The queue's size in `queue_counts` (summed: a submit read every queued sequence's index
# entry, twice, to count them), set up where the schema is created or migrated: the count
# taken and the triggers created under one lock on `sequences`, so none of its writes
# falls between (a version-6 replica running beside a migration waits for it). Row 0
# holds the start and what the rows of ended server processes held (the keepers fold
# them: reclaim_expired).
_QUEUE_COUNTING = """
LOCK TABLE sequences IN SHARE ROW EXCLUSIVE MODE;
CREATE TABLE IF NOT EXISTS queue_counts (
    backend bigint PRIMARY KEY,         -- pg_backend_pid() of the writer; 0: folded
    queued  bigint NOT NULL
);
DELETE FROM queue_counts;
INSERT INTO queue_counts SELECT 0, count(*) FROM sequences WHERE state = 1;
DROP TRIGGER IF EXISTS sequences_queued_in ON sequences;
DROP TRIGGER IF EXISTS sequences_queued_moved ON sequences;
DROP TRIGGER IF EXISTS sequences_queued_out ON sequences;
CREATE TRIGGER sequences_queued_in AFTER INSERT ON sequences FOR EACH ROW
    WHEN (NEW.state = 1) EXECUTE FUNCTION lattice_count_queued();
CREATE TRIGGER sequences_queued_moved AFTER UPDATE OF state ON sequences FOR EACH ROW
    WHEN ((OLD.state = 1) <> (NEW.state = 1)) EXECUTE FUNCTION lattice_count_queued();
CREATE TRIGGER sequences_queued_out AFTER DELETE ON sequences FOR EACH ROW
    WHEN (OLD.state = 1) EXECUTE FUNCTION lattice_count_queued();
DROP TRIGGER IF EXISTS sequences_emptied ON sequences;
CREATE TRIGGER sequences_emptied AFTER TRUNCATE ON sequences FOR EACH STATEMENT
    EXECUTE FUNCTION lattice_queue_emptied();
-- A row version a queue change: vacuumed often (it is a page or two when vacuumed).
ALTER TABLE queue_counts SET (autovacuum_vacuum_scale_factor = 0,
                              autovacuum_vacuum_threshold = 1000);
"""

# At every replica start, in one statement (one snapshot: the committed queue and the
# committed counts agree unless something wrote `sequences` past the triggers, such as a
# restore with session_replication_role = replica): what the counts miss goes to row 0.
_QUEUE_RECOUNT = (
    "WITH d AS (SELECT (SELECT count(*) FROM sequences WHERE state = 1) - (SELECT "
    "coalesce(sum(queued), 0) FROM queue_counts) AS drift), u AS (INSERT INTO queue_counts "
    "(backend, queued) SELECT 0, drift FROM d WHERE drift <> 0 ON CONFLICT (backend) DO "
    "UPDATE SET queued = queue_counts.queued + excluded.queued) "
    "SELECT drift FROM d WHERE drift <> 0"
)

# Whether a live worker that takes work has the adapter of `sequences s`: registered on a
# replica whose lease runs, not drained by an operator, its registration listing it.
_SERVED_BY_A_LIVE_WORKER = (
    "EXISTS (SELECT 1 FROM workers w JOIN replicas r ON r.replica_id = w.replica_id "
    "WHERE r.lease_until > now() AND NOT w.drain_requested "
    "AND (w.registration::jsonb -> 'adapters') ? s.adapter_id)"
)

# Columns of a sequence row, in the order _stored_sequence reads them.
# Each term of a queue order's sort key, as SQL over `sequences q` (%(aging)s: the
# order's aging_seconds).
_ORDER_SQL = {
    SortTerm.QUEUE_KEY: "queue_key",
    SortTerm.AGED_PRIORITY: (
        "(priority - floor(greatest(0, extract(epoch from "
        "clock_timestamp()) - submitted_at) / %(aging)s))"
    ),
    SortTerm.TENANT_SERVICE: (
        "coalesce((SELECT t.served FROM tenant_service t WHERE t.tenant = q.tenant), 0)"
    ),
    SortTerm.SUBMITTED_AT: "submitted_at",
    # Submission + the one TTFT target: the same order as the submissions.
    SortTerm.DEADLINE: "submitted_at",
    SortTerm.SEQ_ID: "seq_id",
}

# A commit's writes of where a sequence's tokens are (`v.saved`: where its output ends
# after the commit; NULL: no appends): the count, and its log rows are this replica's from
# this commit's row on unless they already were (another replica's rows were folded into
# its head when it was claimed or adopted: `_fold`). %s: this replica.
_LOG_SET = (
    "counted_log = CASE WHEN v.saved IS NULL THEN s.counted_log "
    "ELSE currval('token_log_id_seq') END, "
    "log_replica = CASE WHEN v.saved IS NULL THEN s.log_replica ELSE %s END, "
    "log_from = CASE WHEN v.saved IS NULL OR s.log_from IS NOT NULL THEN s.log_from "
    "ELSE currval('token_log_id_seq') END"
)
_SAVED_SET = "num_saved = coalesce(v.saved, s.num_saved), " + _LOG_SET
# A progress row also carries `v.final`: where the output of a sequence it finishes ends
# (its last appends may be in earlier, uncounted rows), so a finished row's count is whole.
_PROGRESS_SAVED_SET = "num_saved = greatest(coalesce(v.saved, s.num_saved), v.final), " + _LOG_SET

# Its owner's counts row when that lists `sequences s` (its count through c.through_log).
_COUNTS_ROW = (
    "(SELECT c FROM replica_counts c WHERE c.replica_id = s.log_replica "
    "AND s.seq_id = ANY(c.seq_ids))"
)
# The log rows of `sequences s` after those counted, by its row's num_saved or by its
# owner's counts row (at most COUNT_EVERY_COMMITS - 1 rows), as an array; none for a
# finished sequence, whose count is whole (the finishing commit writes it: `v.final`).
_UNCOUNTED = (
    "ARRAY(SELECT t.entries FROM token_log t WHERE s.state <> 4 "
    "AND t.replica_id = s.log_replica AND t.id >= s.log_from "
    "AND t.id > greatest(coalesce(s.counted_log, 0), "
    f"coalesce(({_COUNTS_ROW}).through_log, 0)) ORDER BY t.id)"
)
# The count its owner's counts row holds for `sequences s` (0 when none lists it).
_LISTED_COUNT = (
    f"coalesce((SELECT (c).ends[array_position((c).seq_ids, s.seq_id)] FROM {_COUNTS_ROW} "
    "AS x(c)), 0)"
)

_COLUMNS = (
    "seq_id, params, prompt, state, worker_id, queue_key, cursor, prefilled_tokens, "
    "num_generated, num_generated_at_admission, finish_reason, finish_order, "
    "submitted_at, admission_order, error_message"
)


# The watcher's reading (`PostgresState.watch`): the other replicas' commit numbers, and
# the largest seq_id (a row even with no other replica: the LEFT JOIN).
_WATCH = (
    "SELECT false, r.replica_id, r.last_commit, m.newest FROM (SELECT "
    "coalesce(max(seq_id), 0) AS newest FROM sequences) m LEFT JOIN replicas r "
    "ON r.replica_id <> %s"
)


@dataclass(frozen=True)
class RemoteOutput:
    """A sequence's tokens from some offset on, as the database holds them."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    error_message: str = ""
    owner: int | None = None  # the replica that owned it when read (None: unclaimed)
    # Logprobs are not persisted: a read of the database has none (an OutputView's shape).
    logprobs: tuple = ()
    prompt_logprobs: tuple = ()


@dataclass(frozen=True)
class Watched:
    """One reading of `PostgresState.watch`."""

    marks: dict[int, int]  # the other live replicas' last commit numbers
    newest: int  # the largest seq_id visible (0: none)
    filled: tuple[int, ...]  # those of `pending` visible now
    claimed: tuple[int, ...] = ()  # those of `unclaimed` that have an owner now


@dataclass(frozen=True)
class Claimed:
    """Sequences a claim gave this replica, and the tenants' counters at that moment."""

    sequences: list[StoredSequence]
    tenant_service: dict[str, float]
    cancel_requested: list[int]


class PostgresState:
    """StateStore of one replica over the shared database, plus what replicas need."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        lease_ttl_seconds: float = 5.0,
        affinity_seconds: float = 0.0,
        fsync: str = "acks",
        order: QueueOrder = ArrivalOrder(),
        pool_size: int = 8,
        connect_timeout_seconds: float = 5.0,
    ) -> None:
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(f"state {url!r}: a PostgreSQL URL starts with postgresql://")
        self.url = url
        self.name = name
        self.lease_ttl_seconds = lease_ttl_seconds
        self._fsync = fsync
        # Claims take the head of the shared queue in this order (the cores' own).
        self._claim_order = ", ".join(_ORDER_SQL[term] for term in order.sort_key)
        self._aging_seconds = order.aging_seconds
        # Claims leave a sequence homed on another live replica (its prefix is cached
        # there) to that replica for this long after its submission (0: homes off).
        self._affinity_seconds = affinity_seconds
        # The prompts of sequences this replica owns, for the home key of their text at
        # their finish (written by the commit thread, read there and by claims).
        self._prompts: dict[int, tuple[int, ...]] = {}
        self._timeout = connect_timeout_seconds
        # Tenant counters as last saved or read by this replica: saves add the difference.
        self._tenant_base: dict[str, float] = {}
        # Group commit (defer_saves): saves collected since the last commit, and figures.
        self._deferred = False
        self._pending = SaveBatch()
        self._pending_lock = threading.Lock()
        self.num_saves = 0  # collected so far (deferred)
        self.num_saves_committed = 0
        self.num_commits = 0
        # Ownership as the last checked commit saw it: the fence read under FOR SHARE and
        # the unfinished sequences owned then, plus those claimed or adopted since. A
        # commit touching only these, under the same fence, needs no per-row check.
        self._fence: int | None = None
        self._owned = OwnedSet()
        # Commit numbers (replicas.last_commit): the last one handed out, and the batch
        # whose commit failed, retried under its number before anything newer.
        self._last_commit_no = 0
        self._unsettled: SaveBatch | None = None
        # A steady batch (appends only) on the fast path commits as one lattice_append call
        # (bench/pg_commit_cost.py compares it with the separate statements).
        self._steady_in_one_statement = True
        # Sequences a commit left out (another replica owns them) not yet returned to the
        # caller: a retry committed, then a newer batch failed.
        self._unreported: frozenset[int] = frozenset()
        # Each owned sequence's num_saved as this replica last wrote it (commit thread; a
        # sequence taken or handed back leaves it, so its next append writes its row), and
        # those the commit being written writes.
        self._counted: dict[int, int] = {}
        self._counts_written: dict[int, int] = {}
        # Where each of those sequences' saved output ends (the count a finishing commit
        # writes when its own appends do not: `_PROGRESS_SAVED_SET`), and the commit's.
        self._saved_ends: dict[int, int] = {}
        self._ends_written: dict[int, int] = {}
        # This replica's log rows since its counts row was last written (replica_counts),
        # and what the commit being written does: None (no log row), False (a log row),
        # True (a log row and the counts row).
        self._log_rows_uncounted = 0
        self._counts_row_written: bool | None = None
        # Token log reads: (seq_id, tokens read) -> the last row id they came from, so a
        # stream reads only newer rows; and where collecting the log goes on from.
        self._read_cursors: dict[tuple[int, int], int] = {}
        # The token log's retention, in rows behind the newest (collect_token_log).
        self.max_log_rows_behind = FOLD_ROWS_BEHIND
        # Blocking exchanges with the server, by purpose (figures; counted where the code
        # waits for the server: one per statement outside a pipeline, one per pipeline sync).
        self.round_trips: Counter[str] = Counter()
        try:
            # One connection first: where it fails (refused, bad password, no database),
            # psycopg says why, while the pool only logs it and times out.
            psycopg.connect(url, connect_timeout=max(1, int(connect_timeout_seconds))).close()
            self._pool = ConnectionPool(
                url,
                min_size=1,
                max_size=pool_size,
                open=True,
                timeout=connect_timeout_seconds,
                kwargs={
                    "autocommit": True,
                    "connect_timeout": int(connect_timeout_seconds),
                    # Worker progress commits without waiting for the WAL flush
                    # (--state-fsync acks, never); acknowledged commits ask for it.
                    **({} if fsync == "always" else {"options": "-c synchronous_commit=off"}),
                },
                name=f"lattice-{name}",
            )
            self._pool.wait(timeout=connect_timeout_seconds)
            self._create_schema()
            self.replica_id = self._join()
        except (psycopg.Error, PoolTimeout) as err:
            self.close()
            raise ConfigError(
                f"state {_redacted(url)}: cannot use the database: {_first_line(err)}"
            ) from None

    @property
    def path(self) -> str:
        return _redacted(self.url)

    # ------------------------------------------------------------------ StateStore

    def load(self) -> StoredState:
        """What this replica owns: nothing for a new replica_id (a restarted process is a
        new replica; its old sequences come back through the lease rules)."""
        with self._connection() as conn:
            sequences = self._read_sequences(
                conn, "WHERE owner = %s AND state <> 4", (self.replica_id,)
            )
            served = dict(conn.execute("SELECT tenant, served FROM tenant_service"))
        self._tenant_base = dict(served)
        return StoredState(sequences=sequences, workers=[], next_seq_id=1, tenant_service=served)

    def save(self, changes: StateChanges) -> None:
        """Commit `changes` now (Disowned if it touches a sequence another replica owns:
        nothing applied); after `defer_saves`, add them to the next group commit."""
        if changes.created:
            raise StoreError("replicas submit through the shared queue, not the core")
        if self._deferred:
            with self._pending_lock:
                self._pending.absorb(changes)
                self.num_saves += 1
            return
        batch = SaveBatch()
        batch.absorb(changes)
        self._commit(batch, drop_disowned=False)

    def defer_saves(self) -> None:
        """From now on `save` only collects; `commit_pending` commits what was collected
        (the replica's servicer answers a call only after the commit that holds its save:
        service/state/pg_commit.py)."""
        self._deferred = True

    def commit_pending(self) -> frozenset[int]:
        """Commit every save collected so far (one round trip when ownership is as last
        seen); returns the ids another replica owns now, whose changes were left out (the
        core gives them up). StoreError: nothing newer is committed, and the saves stay for
        the next call. A batch whose commit failed is retried first, alone and under its
        commit number: if the failed attempt did commit, the retry applies nothing twice."""
        if self._unsettled is not None:
            self._unreported |= self._commit(self._unsettled, drop_disowned=True)
            self._unsettled = None
        with self._pending_lock:
            batch, self._pending = self._pending, SaveBatch()
        if batch.num_saves:
            try:
                self._unreported |= self._commit(batch, drop_disowned=True)
            except BaseException:
                self._unsettled = batch
                raise
        lost, self._unreported = self._unreported, frozenset()
        return lost

    def _commit(self, batch: SaveBatch, drop_disowned: bool) -> frozenset[int]:
        """Write `batch` in one transaction under its commit number (drawn at its first
        attempt). Fast path: this replica's fence is as last seen and every sequence
        touched is one it knew it owned then: BEGIN, the number and fence check, the
        writes and COMMIT in one pipeline (one round trip); a batch of appends only (a
        steady decode step) as one statement on its own (lattice_append). Otherwise (or when the fast
        path finds ownership moved) the slow path locks the rows and checks each, as every
        save did before group commit. An attempt that finds its number recorded (an
        earlier one committed) rolls back and counts as committed."""
        if batch.commit_no == 0:
            self._last_commit_no += 1
            batch.commit_no = self._last_commit_no
        touched = batch.touched()
        sync = self._fsync == "always" or (self._fsync == "acks" and batch.sync)
        with self._connection() as conn:
            if self._fence is not None and self._owned.covers(touched):
                try:
                    if self._steady_in_one_statement and self._is_steady(batch):
                        self._append(conn, batch, sync)
                        self.round_trips["save"] += 1
                        self._committed(batch, frozenset())
                        return frozenset()
                    with conn.pipeline(), conn.transaction():
                        if sync and self._fsync == "acks":
                            conn.execute("SET LOCAL synchronous_commit TO on")
                        conn.execute(
                            _RECORD_COMMIT,
                            {
                                "me": self.replica_id,
                                "fence": self._fence if touched else None,
                                "no": batch.commit_no,
                            },
                        )
                        self._write(conn, batch)
                    self.round_trips["save"] += 1
                    self._committed(batch, frozenset())
                    return frozenset()
                except psycopg.Error as err:
                    self.round_trips["save"] += 1
                    if err.sqlstate == _DONE_SQLSTATE:
                        self._committed(batch, frozenset())
                        return frozenset()
                    if err.sqlstate != _DISOWNED_SQLSTATE:
                        raise
            try:
                return self._commit_checked(conn, batch, touched, sync, drop_disowned)
            except psycopg.Error as err:
                if err.sqlstate != _DONE_SQLSTATE:
                    raise
                self._committed(batch, frozenset())
                return frozenset()

    def _commit_checked(
        self, conn, batch: SaveBatch, touched: set[int], sync: bool, drop_disowned: bool
    ) -> frozenset[int]:
        """The slow path: record the commit number, read the fence and what this replica
        owns, lock and check the rows touched; write what is still owned (or refuse it
        all: Disowned)."""
        with self._owned.refreshing() as read, conn.transaction():
            if sync and self._fsync == "acks":
                conn.execute("SET LOCAL synchronous_commit TO on")
            conn.execute(
                _RECORD_COMMIT, {"me": self.replica_id, "fence": None, "no": batch.commit_no}
            )
            row = conn.execute(
                "SELECT fence FROM replicas WHERE replica_id = %s FOR SHARE", (self.replica_id,)
            ).fetchone()
            owned = {
                r[0]
                for r in conn.execute(
                    "SELECT seq_id FROM sequences WHERE owner = %s AND state <> 4",
                    (self.replica_id,),
                )
            }
            locked = {
                r[0]
                for r in conn.execute(
                    "SELECT seq_id FROM sequences WHERE seq_id = ANY(%s) AND owner = %s FOR UPDATE",
                    (list(touched), self.replica_id),
                )
            }
            self.round_trips["save"] += 5
            lost = frozenset(touched - locked)
            if lost:
                if not drop_disowned:
                    raise Disowned(lost)
                batch = batch.without(lost)
            self._write(conn, batch)
            read.append(owned - lost)
        self._fence = None if row is None else row[0]
        self._committed(batch, lost)
        return lost

    def _home_keys(self, batch: SaveBatch) -> list[int]:
        """The prefix keys of the texts of the sequences that finished in `batch`."""
        keys = set()
        for seq_id, output in batch.final_outputs.items():
            prompt = self._prompts.get(seq_id)
            if prompt is not None:
                key = finished_key(prompt, output)
                if key is not None:
                    keys.add(key)
        return sorted(keys)

    def _committed(self, batch: SaveBatch, lost: frozenset[int]) -> None:
        self._counted.update(self._counts_written)
        self._counts_written = {}
        if self._counts_row_written is not None:
            self._log_rows_uncounted = (
                0 if self._counts_row_written else self._log_rows_uncounted + 1
            )
        self._counts_row_written = None
        self._saved_ends.update(self._ends_written)
        self._ends_written = {}
        for seq_id in (*batch.finished(), *batch.forgotten, *lost):
            self._counted.pop(seq_id, None)
            self._saved_ends.pop(seq_id, None)
        for seq_id in (*batch.final_outputs, *batch.forgotten, *lost):
            self._prompts.pop(seq_id, None)
        for tenant, served in batch.tenant_service.items():
            self._tenant_base[tenant] = served
        self._owned.discard((*batch.finished(), *batch.forgotten))
        self.num_commits += 1
        self.num_saves_committed += batch.num_saves

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close(timeout=1.0)

    # ------------------------------------------------------------------ clients

    def submit(self, params: SubmitParams, max_queue: int, max_per_tenant: int) -> SubmitResult:
        """Commit a new sequence to the shared queue (synchronous commit) before answering;
        a known request_id answers its first seq_id."""
        with self._connection() as conn:
            try:
                status, seq_id, position = conn.execute(
                    "SELECT status, seq_id, queue_position FROM lattice_enqueue("
                    "%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    self.enqueue_args(params, max_queue, max_per_tenant),
                ).fetchone()
            except psycopg.DataError as err:
                # This request's own values (the edge refuses every one known to do this:
                # service/server/convert.py): a retry cannot help, and nothing was written.
                raise InvalidArgument(
                    f"the shared queue cannot hold this request: {_first_line(err)}"
                ) from None
            self.round_trips["submit"] += 1
        if status == 2:
            raise QueueFull(
                f"the admission queue holds max_queue={max_queue} sequences; retry later"
            )
        if status == 3:
            raise QueueFull(
                f"tenant {params.tenant!r} already has {max_per_tenant} sequences "
                f"queued (max_queue_per_tenant={max_per_tenant}); retry later"
            )
        return SubmitResult(seq_id, position)

    def enqueue_args(self, params: SubmitParams, max_queue: int, max_per_tenant: int) -> tuple:
        """lattice_enqueue's twelve arguments for `params` (`submit`'s; bench.pg_commit_cost
        calls it in groups)."""
        return (
            params.principal,
            params.adapter_id,
            params.request_id or None,
            params_json(params),
            pack_token_ids(params.prompt_token_ids),
            params.priority,
            params.tenant,
            params.max_new_tokens,
            max_queue,
            max_per_tenant,
            self._fsync != "never",
            prompt_keys(params.prompt_token_ids) if self._affinity_seconds else [],
        )

    def cancel(self, seq_id: int, caller: Caller = SEES_ALL) -> bool:
        """Cancel a sequence this replica does not own; False if it had finished.

        Unclaimed: finished CANCELLED here. Owned by another replica: the request is
        committed (cancel_requested) and the owner is told; it evicts on its worker.
        Another principal's sequence is NotFound to `caller`, as an unknown id."""
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            row = conn.execute(
                "SELECT state, owner, principal FROM sequences WHERE seq_id = %s FOR UPDATE",
                (seq_id,),
            ).fetchone()
            if row is None or not caller.may_see(row[2]):
                raise NotFound.seq_id(seq_id)
            state, owner, _ = row
            if state == _FINISHED:
                return False
            if owner is None:
                conn.execute(
                    "UPDATE sequences SET state = 4, finish_reason = %s, "
                    "queue_key = NULL, worker_id = NULL WHERE seq_id = %s",
                    (FinishReason.CANCELLED.value, seq_id),
                )
                conn.execute("SELECT pg_notify(%s, %s)", (PROGRESS_CHANNEL, str(seq_id)))
            else:
                conn.execute(
                    "UPDATE sequences SET cancel_requested = true WHERE seq_id = %s", (seq_id,)
                )
                conn.execute("SELECT pg_notify(%s, %s)", (CANCEL_CHANNEL, f"{owner}:{seq_id}"))
        return True

    def sequence_info(self, seq_id: int, caller: Caller = SEES_ALL) -> SequenceInfo:
        """The database's view of `seq_id`; NotFound as in `cancel`."""
        with self._connection() as conn:
            row = conn.execute(
                "SELECT state, worker_id, octet_length(prompt) / 4, prefilled_tokens, "
                f"greatest(num_generated, num_saved, {_LISTED_COUNT}), finish_reason, "
                "CASE WHEN state = 1 THEN (SELECT count(*) FROM sequences q WHERE q.state = 1 "
                "AND (q.queue_key, q.seq_id) < (s.queue_key, s.seq_id)) ELSE 0 END, "
                "error_message, principal, CASE WHEN state = 1 AND adapter_id <> '' AND NOT "
                f"{_SERVED_BY_A_LIVE_WORKER} THEN adapter_id END, {_UNCOUNTED} "
                "FROM sequences s WHERE seq_id = %s",
                (seq_id,),
            ).fetchone()
            if row is None or not caller.may_see(row[-3]):
                raise NotFound.seq_id(seq_id)
        *row, uncounted = row
        for blob in uncounted:  # the appends its row does not count yet
            for _, start, token_ids in unpack_entries(bytes(blob), {seq_id}):
                row[4] = max(row[4], start + len(token_ids))
        (
            state,
            worker_id,
            prompt_len,
            prefilled,
            generated,
            reason,
            position,
            error,
            _,
            unserved_adapter,
        ) = row
        if unserved_adapter is not None:
            error = no_worker_has(unserved_adapter)
        return SequenceInfo(
            seq_id=seq_id,
            state=SequenceState(state),
            worker_id=worker_id or "",
            prompt_len=prompt_len,
            prefilled_tokens=prefilled,
            generated_tokens=int(generated),
            finish_reason=None if reason is None else FinishReason(reason),
            queue_position=int(position),
            error_message=error,
        )

    def read_output(self, seq_id: int, start: int, caller: Caller = SEES_ALL) -> RemoteOutput:
        """Tokens from index `start` on, committed by whichever replica owns it; NotFound
        as in `cancel`."""
        with self._connection() as conn:
            row = conn.execute(
                "SELECT state, finish_reason, error_message, principal, owner FROM "
                "sequences WHERE seq_id = %s",
                (seq_id,),
            ).fetchone()
            if row is None or not caller.may_see(row[3]):
                raise NotFound.seq_id(seq_id)
            # A stream reads on from the log row where its last read ended.
            after = self._read_cursors.pop((seq_id, start), 0)
            outputs = Outputs(start)
            last = self._read_log(conn, [seq_id], outputs, after, start)
            out = outputs.tokens.get(seq_id, [])
        if len(self._read_cursors) > 10_000:
            self._read_cursors.clear()
        self._read_cursors[seq_id, start + len(out)] = max(after, last)
        state, reason, error, _, owner = row
        return RemoteOutput(
            tuple(out),
            state == _FINISHED,
            None if reason is None else FinishReason(reason),
            error,
            owner,
        )

    def publish_address(self, address: str) -> None:
        """Say where the other replicas reach this one (its row's name; `address_of`)."""
        self.name = address  # and at every renewal, should this write fail

        with self._connection() as conn:
            conn.execute(
                "UPDATE replicas SET name = %s WHERE replica_id = %s", (address, self.replica_id)
            )

    def address_of(self, replica_id: int) -> str | None:
        """Where replica `replica_id` is reached (None: no live replica has that id)."""
        with self._connection() as conn:
            row = conn.execute(
                "SELECT name FROM replicas WHERE replica_id = %s AND lease_until > now()",
                (replica_id,),
            ).fetchone()
        return None if row is None else row[0]

    def unservable_queued(self) -> int:
        """Queued sequences, fleet-wide, whose adapter no live worker that takes work has
        (lattice_scheduler_unservable_queued)."""
        with self._connection() as conn:
            return conn.execute(
                "SELECT count(*) FROM sequences s WHERE state = 1 AND adapter_id <> '' "
                f"AND NOT {_SERVED_BY_A_LIVE_WORKER}"
            ).fetchone()[0]

    def unclaimed_tokens_up_to(self, priority: int) -> tuple[int, int]:
        """Prompt tokens of the unclaimed queued sequences of `priority` or a more urgent
        one (lower), and how many replicas hold a live lease (to share them among)."""
        with self._connection() as conn:
            tokens, num_replicas = conn.execute(
                "SELECT coalesce(sum(octet_length(prompt) / 4), 0), "
                "(SELECT count(*) FROM replicas WHERE lease_until > now()) "
                "FROM sequences WHERE state = 1 AND owner IS NULL AND priority <= %s",
                (priority,),
            ).fetchone()
        return int(tokens), int(num_replicas)

    def queue_depth(self) -> int:
        with self._connection() as conn:
            return conn.execute(
                "SELECT coalesce(sum(queued), 0)::bigint FROM queue_counts"
            ).fetchone()[0]

    # ------------------------------------------------------------------ ownership

    def claim(self, count: int, adapters: Collection[str] = ()) -> Claimed:
        """Take up to `count` unclaimed queued sequences that need no adapter or one of
        `adapters` (those of the workers that will run them), head first in the queue
        order (FOR UPDATE SKIP LOCKED: two replicas never take the same one, nor wait)."""
        order = self._claim_order
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            ids = [
                row[0]
                for row in conn.execute(
                    f"UPDATE sequences s SET owner = %(me)s FROM (SELECT seq_id FROM sequences q "
                    f"WHERE state = 1 AND owner IS NULL AND (adapter_id = '' OR adapter_id = "
                    f"ANY(%(adapters)s)){self._homes_sql()} ORDER BY {order} LIMIT %(n)s "
                    f"FOR UPDATE SKIP LOCKED) c WHERE s.seq_id = c.seq_id RETURNING s.seq_id",
                    {
                        "me": self.replica_id,
                        "n": count,
                        "aging": self._aging_seconds,
                        "adapters": sorted(adapters),
                        "affinity": self._affinity_seconds,
                    },
                )
            ]
            sequences = self._read_sequences(conn, "WHERE seq_id = ANY(%s)", (ids,)) if ids else []
            # No NOTIFY (it would wake every replica's listener at every claim that takes
            # any): streams elsewhere of these find their owner in their watcher's reading.
            self._fold_claimed(conn, sequences)
            served = dict(conn.execute("SELECT tenant, served FROM tenant_service"))
            # BEGIN, SET LOCAL, UPDATE, the rows and their tokens (when any), counters,
            # COMMIT.
            self.round_trips["claim"] += 5 + (2 if ids else 0)
        self._tenant_base.update(served)
        self._uncount(ids)
        self._owned.add(ids)
        self._remember_prompts(sequences)
        return Claimed(sequences, served, [])

    def _fold_claimed(self, conn, sequences: list[StoredSequence]) -> None:
        """Sequences this replica just took (rows locked) whose tokens sit in another
        replica's log rows: into their heads, so this replica's commits log them on in
        its own rows. Nothing (no statement) when none has tokens: a fresh claim."""
        self._fold(
            conn, {seq.seq_id: seq.output_token_ids for seq in sequences if seq.output_token_ids}
        )

    def _uncount(self, seq_ids: Iterable[int]) -> None:
        """Their rows were (or will be) written elsewhere: the next append writes its own."""
        for seq_id in seq_ids:
            self._counted.pop(seq_id, None)
            self._saved_ends.pop(seq_id, None)

    def _homes_sql(self) -> str:
        """The claim's condition for homes: a sequence homed on another live replica is
        left to it until `affinity_seconds` after its submission (then anyone's, in the
        queue order); nothing with homes off."""
        if not self._affinity_seconds:
            return ""
        return (
            " AND (home IS NULL OR home = %(me)s OR submitted_at < "
            "extract(epoch from clock_timestamp()) - %(affinity)s OR NOT EXISTS (SELECT 1 "
            "FROM replicas r WHERE r.replica_id = q.home AND r.lease_until > now()))"
        )

    def _remember_prompts(self, sequences: list[StoredSequence]) -> None:
        if self._affinity_seconds:
            for seq in sequences:
                self._prompts[seq.seq_id] = seq.params.prompt_token_ids

    def forget_prompts(self, seq_ids: Iterable[int]) -> None:
        """Sequences given up (another replica owns them now): no home key here, and no
        count of theirs kept."""
        for seq_id in seq_ids:
            self._prompts.pop(seq_id, None)
            self._counted.pop(seq_id, None)
            self._saved_ends.pop(seq_id, None)

    def adopt_worker(self, worker_id: str) -> Claimed:
        """Take the sequences assigned to `worker_id` from whichever replica held them (the
        worker registered here: it moved). Their old owner's saves are refused from now."""
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            # The old owners' fences first (a take-over locks replicas, then sequences, as
            # their commits do): from now on their commits check each row.
            conn.execute(
                "UPDATE replicas SET fence = nextval('lattice_fences') WHERE replica_id IN "
                "(SELECT DISTINCT owner FROM sequences WHERE worker_id = %(w)s AND state IN "
                "(2, 3) AND owner IS DISTINCT FROM %(me)s)",
                {"w": worker_id, "me": self.replica_id},
            )
            rows = conn.execute(
                "WITH old AS (SELECT seq_id, owner FROM sequences WHERE worker_id = %(w)s "
                "AND state IN (2, 3) AND owner IS DISTINCT FROM %(me)s FOR UPDATE) "
                "UPDATE sequences s SET owner = %(me)s FROM old WHERE s.seq_id = old.seq_id "
                "RETURNING s.seq_id, s.cancel_requested, old.owner",
                {"w": worker_id, "me": self.replica_id},
            ).fetchall()
            ids = [seq_id for seq_id, _, _ in rows]
            sequences = self._read_sequences(conn, "WHERE seq_id = ANY(%s)", (ids,)) if ids else []
            self._fold_claimed(conn, sequences)
            by_owner: dict[int, list[int]] = {}
            for seq_id, _, owner in rows:
                if owner is not None:
                    by_owner.setdefault(owner, []).append(seq_id)
            for owner, seq_ids in by_owner.items():  # the old owner forgets them at once
                conn.execute(
                    "SELECT pg_notify(%s, %s)", (DISOWN_CHANNEL, f"{owner}:{_ids_payload(seq_ids)}")
                )
        self._uncount(ids)
        self._owned.add(ids)
        self._remember_prompts(sequences)
        return Claimed(sequences, {}, [seq_id for seq_id, flag, _ in rows if flag])

    def next_incarnation(self) -> int:
        """A worker incarnation number no replica has handed out."""
        with self._connection() as conn:
            return conn.execute("SELECT nextval('lattice_incarnations')").fetchone()[0]

    def cancel_requests(self) -> list[int]:
        """Unfinished sequences of this replica another replica asked to cancel."""
        with self._connection() as conn:
            return [
                row[0]
                for row in conn.execute(
                    "SELECT seq_id FROM sequences WHERE owner = %s AND cancel_requested "
                    "AND state <> 4",
                    (self.replica_id,),
                )
            ]

    def owned_ids(self) -> set[int]:
        with self._connection() as conn:
            return {
                row[0]
                for row in conn.execute(
                    "SELECT seq_id FROM sequences WHERE owner = %s AND state <> 4",
                    (self.replica_id,),
                )
            }

    def renew_lease(self) -> bool:
        """Extend this replica's lease; False if it had run out and others took what it
        owned (the row is written again: the caller must give up what it no longer owns)."""
        with self._connection() as conn:
            renewed = conn.execute(
                "UPDATE replicas SET lease_until = now() + make_interval(secs => %s), "
                "name = %s WHERE replica_id = %s",
                (self.lease_ttl_seconds, self.name, self.replica_id),
            ).rowcount
            if not renewed:
                self._insert_lease(conn, self.replica_id)
        return bool(renewed)

    def reclaim_expired(self) -> int:
        """Return what replicas whose lease ran out owned to the shared queue: claimed
        but unadmitted sequences keep their place, assigned ones go to the head and resume
        from their saved tokens (asked-to-cancel ones finish CANCELLED). Returns how many
        sequences moved. Then take the owner off up to `FINISHED_OWNERS_A_ROUND` of those
        replicas' finished sequences, in a transaction of its own (a replica's retained
        finished sequences can be many: one transaction for all held the requeue, and
        cancels of those rows, for seconds)."""
        moved, orphaned = self._reclaim()
        if orphaned:
            with self._connection() as conn:
                conn.execute(
                    "UPDATE sequences SET owner = NULL WHERE seq_id IN (SELECT seq_id FROM "
                    "sequences s WHERE owner = ANY(%s) AND state = 4 AND NOT EXISTS (SELECT "
                    "1 FROM replicas r WHERE r.replica_id = s.owner) LIMIT %s FOR UPDATE "
                    "SKIP LOCKED)",
                    (orphaned, FINISHED_OWNERS_A_ROUND),
                )
        return moved

    def _reclaim(self) -> tuple[int, list[int]]:
        """reclaim_expired's requeue: (sequences moved, the owners without a replica
        row)."""
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            # A dead replica's last commit number outlives its row: a commit it retries
            # once it is back must still find an earlier attempt that committed.
            dead = [
                row[0]
                for row in conn.execute(
                    "WITH d AS (DELETE FROM replicas WHERE lease_until < now() "
                    "RETURNING replica_id, last_commit), k AS (INSERT INTO lattice_meta "
                    "(key, value) SELECT 'last_commit:' || replica_id, last_commit FROM d "
                    "WHERE last_commit > 0 ON CONFLICT (key) DO UPDATE SET value = "
                    "greatest(lattice_meta.value, excluded.value)) SELECT replica_id FROM d"
                )
            ]
            # Homes not renewed for an hour: those caches have long turned over.
            conn.execute("DELETE FROM prefix_homes WHERE updated_at < now() - interval '1 hour'")
            # Owners with no replica row (these dead, and any that left cleanly), found
            # by skipping through the owner index, one probe an owner: a scan of the
            # table ran on every replica at every keeper round and grew with the fleet.
            orphaned = [
                row[0]
                for row in conn.execute(
                    "WITH RECURSIVE o(owner) AS ((SELECT owner FROM sequences WHERE owner "
                    "IS NOT NULL ORDER BY owner LIMIT 1) UNION ALL SELECT (SELECT s.owner "
                    "FROM sequences s WHERE s.owner > o.owner ORDER BY s.owner LIMIT 1) "
                    "FROM o WHERE o.owner IS NOT NULL) SELECT owner FROM o WHERE owner IS "
                    "NOT NULL AND NOT EXISTS (SELECT 1 FROM replicas r WHERE "
                    "r.replica_id = o.owner)"
                )
            ]
            # Their unfinished rows in seq_id order (two keepers lock them in the same
            # order). Their finished ones lose the owner after (reclaim_expired), so the
            # rounds after do not read them again.
            rows = (
                conn.execute(
                    "SELECT seq_id, state, cancel_requested FROM sequences s WHERE "
                    "owner = ANY(%s) AND state <> 4 AND NOT EXISTS (SELECT 1 FROM replicas r "
                    "WHERE r.replica_id = s.owner) ORDER BY seq_id FOR UPDATE",
                    (orphaned,),
                ).fetchall()
                if orphaned
                else []
            )
            # The queue counts of server processes that ended, into row 0 (after the
            # sequence rows above: every keeper locks in that order).
            conn.execute(
                "WITH gone AS (DELETE FROM queue_counts q WHERE backend <> 0 AND NOT EXISTS "
                "(SELECT 1 FROM pg_stat_activity a WHERE a.pid = q.backend) RETURNING queued) "
                "UPDATE queue_counts SET queued = queued + (SELECT sum(queued) FROM gone) "
                "WHERE backend = 0 AND EXISTS (SELECT 1 FROM gone)"
            )
            if not rows and not dead:
                return 0, orphaned
            queued = [seq_id for seq_id, state, cancel in rows if state == _QUEUED and not cancel]
            cancelled = [seq_id for seq_id, state, cancel in rows if cancel]
            assigned = [seq_id for seq_id, state, cancel in rows if state != _QUEUED and not cancel]
            conn.execute("UPDATE sequences SET owner = NULL WHERE seq_id = ANY(%s)", (queued,))
            conn.execute(
                "UPDATE sequences SET owner = NULL, state = 4, finish_reason = %s, "
                "worker_id = NULL, queue_key = NULL WHERE seq_id = ANY(%s)",
                (FinishReason.CANCELLED.value, cancelled),
            )
            saved = self._outputs(conn, assigned + cancelled) if rows else {}
            if cancelled:  # a finished row's count is whole (GetSequence reads no log row)
                conn.execute(
                    "UPDATE sequences s SET num_saved = v.n FROM unnest(%s::bigint[], "
                    "%s::integer[]) AS v(seq_id, n) WHERE s.seq_id = v.seq_id",
                    (cancelled, [len(saved.get(seq_id, ())) for seq_id in cancelled]),
                )
            for seq_id in assigned:  # in seq_id order, each ahead of all
                conn.execute(
                    "UPDATE sequences s SET owner = NULL, state = 1, worker_id = NULL, "
                    "cursor = 0, prefilled_tokens = 0, queue_key = -nextval('lattice_queue_head'), "
                    "num_generated = %s WHERE seq_id = %s",
                    (len(saved.get(seq_id, ())), seq_id),
                )
            conn.execute(
                "DELETE FROM workers w WHERE NOT EXISTS (SELECT 1 FROM replicas r "
                "WHERE r.replica_id = w.replica_id)"
            )
            conn.execute(
                "DELETE FROM replica_counts c WHERE NOT EXISTS (SELECT 1 FROM replicas r "
                "WHERE r.replica_id = c.replica_id)"
            )
            if rows:
                conn.execute("SELECT pg_notify(%s, '')", (SUBMIT_CHANNEL,))
                # Every one of them: streams elsewhere followed the replica that left (a
                # clean leave keeps its assigned ones until a keeper requeues them here).
                conn.execute(
                    "SELECT pg_notify(%s, %s)",
                    (PROGRESS_CHANNEL, _ids_payload(queued + assigned + cancelled)),
                )
        if rows:
            log.warning(
                "replicas' leases ran out; their sequences went back to the shared queue",
                extra={
                    "replicas": dead,
                    "queued": len(queued),
                    "assigned": len(assigned),
                    "cancelled": len(cancelled),
                },
            )
        return len(rows), orphaned

    def release(self, seq_ids: list[int]) -> list[int]:
        """Hand queued sequences back to the shared queue, at their place; returns those
        released (still this replica's and queued)."""
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            released = [
                row[0]
                for row in conn.execute(
                    "UPDATE sequences SET owner = NULL WHERE seq_id = ANY(%s) AND owner = %s "
                    "AND state = 1 RETURNING seq_id",
                    (seq_ids, self.replica_id),
                )
            ]
            if released:
                conn.execute("SELECT pg_notify(%s, '')", (SUBMIT_CHANNEL,))
                # Streams elsewhere follow the commits of the replica that held these;
                # they are no one's now (a rare event: one notification is cheap here).
                conn.execute("SELECT pg_notify(%s, %s)", (PROGRESS_CHANNEL, _ids_payload(released)))
        self._owned.discard(released)
        self._uncount(released)
        for seq_id in released:
            self._prompts.pop(seq_id, None)
        return released

    def leave(self) -> None:
        """A clean stop: claimed but unadmitted sequences go back to the shared queue at
        their place, the lease ends, and others return the rest at once."""
        with self._connection() as conn, conn.transaction():
            self._durable(conn)
            conn.execute(
                "UPDATE sequences SET owner = NULL WHERE owner = %s AND state = 1",
                (self.replica_id,),
            )
            conn.execute("DELETE FROM replicas WHERE replica_id = %s", (self.replica_id,))
            conn.execute("DELETE FROM replica_counts WHERE replica_id = %s", (self.replica_id,))
            # The number a keeper kept if the lease had run out: no retry will read it now.
            conn.execute(
                "DELETE FROM lattice_meta WHERE key = 'last_commit:' || %s", (self.replica_id,)
            )
            conn.execute("SELECT pg_notify(%s, '')", (SUBMIT_CHANNEL,))

    def watch(
        self,
        conn: psycopg.Connection,
        pending: Collection[int] = (),
        unclaimed: Collection[int] = (),
    ) -> Watched:
        """One reading of what no notification announces, on `conn` (a
        `watch_connection`), in one statement: the other live replicas' commit numbers and
        the largest seq_id visible; and, when there are any, which of `pending` are
        visible and which of `unclaimed` (sequences that streams here wait on, unclaimed
        when last read) have an owner now. (Not "the ids above the last newest": a range
        on a small or bloated table is planned as a scan of it; max() and `= ANY` take the
        primary key's index whatever its size. The ids in the same statement, not a second
        one: a round trip is most of such a reading's cost to PostgreSQL; without ids, the
        first part alone, which costs less than both with none to look up.)"""
        asked, streamed = set(pending), set(unclaimed)
        if asked or streamed:
            rows = conn.execute(
                _WATCH + " UNION ALL SELECT true, seq_id, (owner IS NOT NULL)::int, 0 "
                "FROM sequences WHERE seq_id = ANY(%s::bigint[])",
                (self.replica_id, list(asked | streamed)),
                prepare=True,
            ).fetchall()
        else:
            rows = conn.execute(_WATCH, (self.replica_id,), prepare=True).fetchall()
        self.round_trips["watch"] += 1
        marks: dict[int, int] = {}
        newest = 0
        filled: list[int] = []
        claimed: list[int] = []
        for is_id, key, value, largest in rows:
            if not is_id:
                newest = largest
                if key is not None:
                    marks[key] = value
            else:
                if key in asked:
                    filled.append(key)
                if value and key in streamed:
                    claimed.append(key)
        return Watched(marks, newest, tuple(sorted(filled)), tuple(sorted(claimed)))

    def watch_connection(self) -> psycopg.Connection:
        """A connection of its own for `watch`: generic plans (a custom plan for each
        reading cost PostgreSQL twice the CPU of the reading itself)."""
        conn = self.own_connection()
        conn.execute("SET plan_cache_mode = force_generic_plan")
        return conn

    def own_connection(self) -> psycopg.Connection:
        """A connection of its own (not pooled), in autocommit."""
        return psycopg.connect(self.url, autocommit=True, connect_timeout=int(self._timeout))

    def listen_connection(self) -> psycopg.Connection:
        """A connection of its own (not pooled) listening on the replicas' channels."""
        conn = self.own_connection()
        for channel in (SUBMIT_CHANNEL, PROGRESS_CHANNEL, CANCEL_CHANNEL, DISOWN_CHANNEL):
            conn.execute(f"LISTEN {channel}")
        return conn

    # ------------------------------------------------------------------ internals

    def _connection(self):
        """A pooled connection; a database that cannot be reached is a StoreError."""
        return _PooledConnection(self._pool, self._timeout)

    def _durable(self, conn) -> None:
        """This transaction's commit waits for the WAL flush (ownership moves and
        acknowledged changes), unless --state-fsync never."""
        if self._fsync == "acks":
            conn.execute("SET LOCAL synchronous_commit TO on")

    def _create_schema(self) -> None:
        with self._pool.connection() as conn, conn.transaction():
            # One replica creates the schema at a time (CREATE ... IF NOT EXISTS races).
            conn.execute("SELECT pg_advisory_xact_lock(7254112)")
            version = None
            if conn.execute("SELECT to_regclass('lattice_meta')").fetchone()[0] is not None:
                row = conn.execute(
                    "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
                ).fetchone()
                version = None if row is None else row[0]
            current = version == SCHEMA_VERSION
            # From version 6, beside running version-6 replicas: none of _SCHEMA runs.
            in_place = version == 6
            if version == 1:
                conn.execute(_FROM_VERSION_1)
                version = 2
            if version == 2:
                # A version-2 replica never moves a fence: one still running could take
                # sequences from a version-3 replica whose fast-path commits then pass.
                _refuse_while_live(conn, 2)
                conn.execute(_FROM_VERSION_2)
                version = 3
            if version == 3:
                # A version-3 replica writes token log rows no version-4 replica finds, and
                # no commit numbers: none may run while the log is folded away.
                _refuse_while_live(conn, 3)
                conn.execute(_FROM_VERSION_3)
                _fold_all_tokens(conn)
                conn.execute(_FROM_VERSION_3_AFTER_FOLDING)
                version = 4
            if version == 4:
                # A version-4 replica rewrites a sequence's count every 16 tokens and reads
                # past it; with version-5 replicas counting in replica_counts, its reads of
                # their sequences would cover 16 times the log rows: one version at a time.
                _refuse_while_live(conn, 4)
                conn.execute(_FROM_VERSION_4)
                version = 5
            if version == 5:
                _refuse_while_live(conn, 5)
                conn.execute(_FROM_VERSION_5)
                version = 6
            if version == 6:
                conn.execute(_FROM_VERSION_6)
                version = SCHEMA_VERSION
            if version not in (None, SCHEMA_VERSION):
                raise ConfigError(
                    f"the database holds schema version {version}; this "
                    f"scheduler reads version {SCHEMA_VERSION}"
                )
            if current or in_place:
                conn.execute(_FUNCTIONS)
            else:
                conn.execute(_SCHEMA + _FUNCTIONS)
            if not current:
                conn.execute(_QUEUE_COUNTING)
            drift = conn.execute(_QUEUE_RECOUNT).fetchone()
            if drift is not None:
                log.warning(
                    "the queue's kept size was off (sequences written past its triggers); "
                    "recounted",
                    extra={"added": drift[0]},
                )
            if version is None:
                conn.execute(
                    "INSERT INTO lattice_meta VALUES ('schema_version', %s) "
                    "ON CONFLICT (key) DO NOTHING",
                    (SCHEMA_VERSION,),
                )

    def _join(self) -> int:
        with self._pool.connection() as conn:
            replica_id = conn.execute("SELECT nextval('lattice_replica_ids')").fetchone()[0]
            self._insert_lease(conn, replica_id)
        return replica_id

    def _insert_lease(self, conn, replica_id: int) -> None:
        """Write this replica's row (again, after its lease ran out: a new fence, and the
        commit number its deleted row held, taken back from lattice_meta)."""
        conn.execute(
            "WITH k AS (DELETE FROM lattice_meta WHERE key = 'last_commit:' || %(id)s "
            "RETURNING value) INSERT INTO replicas (replica_id, name, lease_until, "
            "last_commit) VALUES (%(id)s, %(name)s, now() + make_interval(secs => %(ttl)s), "
            "coalesce((SELECT value FROM k), 0)) ON CONFLICT (replica_id) "
            "DO UPDATE SET lease_until = excluded.lease_until",
            {"id": replica_id, "name": self.name, "ttl": self.lease_ttl_seconds},
        )

    def _outputs(self, conn, seq_ids: list[int]) -> dict[int, list[int]]:
        """The saved output of each of `seq_ids` (those with none are left out)."""
        outputs = Outputs()
        self._read_log(conn, seq_ids, outputs)
        return outputs.tokens

    def _read_log(
        self, conn, seq_ids: list[int], outputs: Outputs, after: int = 0, start: int = 0
    ) -> int:
        """Add the saved tokens of `seq_ids` from index `start` on to `outputs`: each one's
        head, then its log rows (those of its `log_replica` from `log_from` on, and after
        id `after`), in commit order; returns the last row id read. One statement (one
        snapshot: a fold committing meanwhile is seen whole or not at all), on indexes."""
        wanted, last = set(seq_ids), after
        for row_id, seq_id, blob in conn.execute(
            "WITH s AS (SELECT seq_id, output_head, log_replica, log_from FROM sequences "
            "WHERE seq_id = ANY(%(ids)s)) "
            "SELECT 0 AS id, seq_id, substring(output_head from %(from)s) FROM s "
            "WHERE octet_length(output_head) > %(skip)s "
            "UNION ALL SELECT t.id, NULL, t.entries FROM token_log t WHERE t.id IN (SELECT "
            "l.id FROM s JOIN token_log l ON l.replica_id = s.log_replica AND l.id >= s.log_from "
            "AND l.id > %(after)s) ORDER BY id",
            {"ids": seq_ids, "from": 4 * start + 1, "skip": 4 * start, "after": after},
        ):
            if row_id == 0:
                outputs.add(seq_id, start, unpack_token_ids(blob))
                continue
            for seq_id, first, token_ids in unpack_entries(bytes(blob), wanted):
                outputs.add(seq_id, first, token_ids)
            last = row_id
        return last

    def _fold(self, conn, outputs: dict[int, list[int]]) -> None:
        """Sequences this replica just took (rows locked; `outputs` their whole saved
        output, read in this transaction) whose tokens sit in another replica's log rows:
        into their heads, so that this replica's commits log them on in its own rows (the
        first append writes the row: `_uncount`)."""
        if not outputs:
            return
        seq_ids = list(outputs)
        conn.execute(
            "UPDATE sequences s SET output_head = v.head, num_saved = v.n, counted_log = NULL, "
            "log_replica = NULL, log_from = NULL FROM unnest(%s::bigint[], %s::bytea[], "
            "%s::integer[]) AS v(seq_id, head, n) WHERE s.seq_id = v.seq_id "
            "AND s.log_from IS NOT NULL AND s.log_replica <> %s",
            (
                seq_ids,
                [pack_token_ids(outputs[s]) for s in seq_ids],
                [len(outputs[s]) for s in seq_ids],
                self.replica_id,
            ),
            binary=True,
        )

    def collect_token_log(self) -> int:
        """Bound the token log: fold the tokens of every sequence whose first log row is
        more than `max_log_rows_behind` rows behind the newest into its head, then delete
        the rows below the first one any sequence still points at (forgotten sequences
        point at none; neither do queued ones that never ran). So a row lives until it is
        `max_log_rows_behind` rows old, plus one keeper interval, whatever lives long.
        Returns rows deleted."""
        max_rows_behind = self.max_log_rows_behind
        with self._connection() as conn, conn.transaction():
            newest = conn.execute("SELECT max(id) FROM token_log").fetchone()[0]
            if newest is None:
                return 0
            bound = newest - max_rows_behind
            self._lock_log_owners(conn, bound)
            behind = conn.execute(
                "SELECT seq_id, state = 4, octet_length(output_head) / 4 FROM sequences "
                "WHERE log_from < %s ORDER BY seq_id FOR UPDATE",
                (bound,),
            ).fetchall()
            if behind:
                self._fold_behind(conn, behind)
            return conn.execute(
                "DELETE FROM token_log WHERE id < coalesce((SELECT min(log_from) FROM "
                "sequences WHERE log_from IS NOT NULL), %s)",
                (newest + 1,),
            ).rowcount

    def _lock_log_owners(self, conn, bound: int) -> None:
        """Lock the rows of the replicas whose log rows below id `bound` sequences point
        at. Their commits wait meanwhile (each locks its replica row first): every row of
        theirs is committed and read by the fold, and their next rows come after. A commit
        that was under way when the owners were first read may add one: read again until
        none is new."""
        locked: set[int] = set()
        while True:
            owners = {
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT log_replica FROM sequences WHERE log_from < %s", (bound,)
                )
            }
            new = sorted(owners - locked)
            if not new:
                return
            conn.execute(
                "SELECT 1 FROM replicas WHERE replica_id = ANY(%s) ORDER BY replica_id FOR UPDATE",
                (new,),
            )
            locked.update(new)

    def _fold_behind(self, conn, behind: list[tuple[int, bool, int]]) -> None:
        """Fold the sequences of `behind` (seq_id, finished, tokens in its head; rows and
        owners locked). A finished one's tokens go into its head and it points at no log
        row from then on (it appends no more: no later fold touches it). An unfinished one
        points past every row handed out by now; its head is rewritten only when its log
        rows held tokens."""
        seq_ids = [seq_id for seq_id, _, _ in behind]
        outputs = self._outputs(conn, seq_ids)
        heads: list[bytes | None] = []
        counts: list[int | None] = []
        for seq_id, _, num_in_head in behind:
            output = outputs.get(seq_id, [])
            grown = len(output) > num_in_head
            heads.append(pack_token_ids(output) if grown else None)
            counts.append(len(output) if grown else None)
        # Their owners' next rows get higher ids than any handed out by now.
        last = conn.execute("SELECT last_value FROM token_log_id_seq").fetchone()[0]
        conn.execute(
            "UPDATE sequences s SET output_head = coalesce(v.head, s.output_head), "
            "num_saved = coalesce(v.n, s.num_saved), "
            "counted_log = CASE WHEN v.done THEN NULL ELSE %s::bigint END, "
            "log_replica = CASE WHEN v.done THEN NULL ELSE s.log_replica END, "
            "log_from = CASE WHEN v.done THEN NULL ELSE %s::bigint END "
            "FROM unnest(%s::bigint[], %s::boolean[], %s::bytea[], %s::integer[]) "
            "AS v(seq_id, done, head, n) WHERE s.seq_id = v.seq_id",
            (last, last + 1, seq_ids, [done for _, done, _ in behind], heads, counts),
            binary=True,
        )

    def _read_sequences(self, conn, where: str, args: tuple) -> list[StoredSequence]:
        rows = conn.execute(
            f"SELECT {_COLUMNS}, num_saved FROM sequences {where} ORDER BY seq_id", args
        ).fetchall()
        # Only sequences with tokens are read on (a first append writes num_saved).
        with_tokens = [row[0] for row in rows if row[-1]]
        tokens = self._outputs(conn, with_tokens) if with_tokens else {}
        return [_stored_sequence(row[:-1], tokens.get(row[0], [])) for row in rows]

    def _counts_entries(
        self, batch: SaveBatch, saved_end: dict[int, int]
    ) -> tuple[list[int], list[int]]:
        """This replica's counts row, through the log row this commit inserts: where the
        saved output of every unfinished sequence it appended to ends. An entry of one
        another replica took meanwhile is still true of this replica's rows, and unread:
        the taker folded its tokens, so its `log_replica` is no longer this replica."""
        ends = {**self._saved_ends, **saved_end}
        for seq_id in (*batch.finished(), *batch.forgotten):
            ends.pop(seq_id, None)
        seq_ids = sorted(ends)
        return seq_ids, [ends[seq_id] for seq_id in seq_ids]

    def _write_counts_row(self, cur, batch: SaveBatch, saved_end: dict[int, int]) -> None:
        seq_ids, ends = self._counts_entries(batch, saved_end)
        cur.execute(
            "INSERT INTO replica_counts (replica_id, through_log, seq_ids, ends) VALUES "
            "(%s, currval('token_log_id_seq'), %s, %s) ON CONFLICT (replica_id) DO UPDATE "
            "SET through_log = excluded.through_log, seq_ids = excluded.seq_ids, "
            "ends = excluded.ends",
            (self.replica_id, seq_ids, ends),
            binary=True,
        )

    def _tenant_deltas(self, service: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
        return [(tenant, served - self._tenant_base.get(tenant, 0.0)) for tenant, served in service]

    def _plan_counts(self, batch: SaveBatch) -> tuple[dict[int, int], dict[int, int]]:
        """Where each sequence's saved output ends after this commit (absolute: a retry
        writes the same), and which of those ends the commit writes to sequence rows;
        remembered as what the commit being written writes (`_committed`)."""
        saved_end: dict[int, int] = {}
        for append in batch.tokens:
            end = append.start + len(append.token_ids)
            saved_end[append.seq_id] = max(saved_end.get(append.seq_id, 0), end)
        self._ends_written = saved_end
        counted = self._counts_written = {}
        for seq_id, end in saved_end.items():
            last = self._counted.get(seq_id)
            if seq_id in batch.progress or last is None or end - last >= COUNT_EVERY_TOKENS:
                counted[seq_id] = end
        self._counts_row_written = None
        return saved_end, counted

    @staticmethod
    def _is_steady(batch: SaveBatch) -> bool:
        """Appends and nothing else (a decode step's save): one lattice_append call."""
        return bool(batch.tokens) and not (
            batch.progress
            or batch.forgotten
            or batch.workers
            or batch.tenant_service
            or batch.final_outputs
        )

    def _append(self, conn, batch: SaveBatch, sync: bool) -> None:
        """A steady batch as one statement in autocommit (its own transaction): the
        number, fence, log row and counts of `_RECORD_COMMIT` and `_write` (no commit
        notifies: the module docstring)."""
        saved_end, counted = self._plan_counts(batch)
        self._counts_row_written = self._log_rows_uncounted + 1 >= COUNT_EVERY_COMMITS
        counts_ids, counts_ends = (
            self._counts_entries(batch, saved_end) if self._counts_row_written else (None, None)
        )
        conn.execute(
            "SELECT lattice_append(%s, %s, %s, %s, %s, %s::bigint[], %s::integer[], "
            "%s::bigint[], %s::integer[], %s)",
            (
                self.replica_id,
                self._fence,
                batch.commit_no,
                sync and self._fsync == "acks",
                pack_entries(batch.tokens),
                counts_ids,
                counts_ends,
                list(counted),
                list(counted.values()),
                None,
            ),
            prepare=True,
            binary=True,
        )

    def _write(self, conn, batch: SaveBatch) -> None:
        """The batch's statements (in a transaction; the caller commits). A progress row
        this replica does not own fails the transaction (lattice_disowned)."""
        me = self.replica_id
        cur = conn.cursor()
        # And the token log row that holds the appends.
        saved_end, counted = self._plan_counts(batch)
        if batch.tokens:  # one token log row for every append of the commit
            cur.execute(
                "INSERT INTO token_log (replica_id, entries) VALUES (%s, %s)",
                (me, pack_entries(batch.tokens)),
                binary=True,
            )
            self._counts_row_written = self._log_rows_uncounted + 1 >= COUNT_EVERY_COMMITS
            if self._counts_row_written:
                self._write_counts_row(cur, batch, saved_end)
        if batch.progress:
            rows = list(batch.progress.values())
            cur.execute(
                "WITH v AS (SELECT * FROM unnest(%s::bigint[], %s::smallint[], %s::text[], "
                "%s::bigint[], %s::integer[], %s::integer[], %s::integer[], %s::integer[], "
                "%s::smallint[], %s::bigint[], %s::bigint[], %s::text[], %s::integer[], "
                "%s::integer[]) AS v(seq_id, state, worker_id, queue_key, cursor, prefilled, "
                "generated, at_admission, reason, finish_order, admission_order, "
                "error_message, saved, final)), "
                "u AS (UPDATE sequences s SET state = v.state, worker_id = v.worker_id, "
                "queue_key = v.queue_key, cursor = v.cursor, prefilled_tokens = v.prefilled, "
                "num_generated = v.generated, num_generated_at_admission = v.at_admission, "
                "finish_reason = v.reason, finish_order = v.finish_order, "
                "admission_order = v.admission_order, error_message = v.error_message, "
                f"{_PROGRESS_SAVED_SET} FROM v WHERE s.seq_id = v.seq_id AND s.owner = %s "
                "RETURNING 1) "
                "SELECT lattice_disowned() FROM (SELECT count(*) AS n FROM u) c WHERE c.n <> %s",
                (
                    [p.seq_id for p in rows],
                    [p.state.value for p in rows],
                    [p.worker_id for p in rows],
                    [p.queue_key for p in rows],
                    [p.cursor for p in rows],
                    [p.prefilled_tokens for p in rows],
                    [p.num_generated for p in rows],
                    [p.num_generated_at_admission for p in rows],
                    [None if p.finish_reason is None else p.finish_reason.value for p in rows],
                    [p.finish_order for p in rows],
                    [p.admission_order for p in rows],
                    [p.error_message for p in rows],
                    [counted.get(p.seq_id) for p in rows],
                    [
                        self._saved_ends.get(p.seq_id)
                        if p.state is SequenceState.FINISHED
                        else None
                        for p in rows
                    ],
                    me,
                    me,
                    len(rows),
                ),
                binary=True,
            )
        unreported = [seq_id for seq_id in counted if seq_id not in batch.progress]
        if unreported:  # appends without a progress change: only the count and the log
            cur.execute(
                "WITH v AS (SELECT * FROM unnest(%s::bigint[], %s::integer[]) AS "
                f"v(seq_id, saved)), u AS (UPDATE sequences s SET {_SAVED_SET} FROM v "
                "WHERE s.seq_id = v.seq_id AND s.owner = %s RETURNING 1) "
                "SELECT lattice_disowned() FROM (SELECT count(*) AS n FROM u) c WHERE c.n <> %s",
                (unreported, [counted[s] for s in unreported], me, me, len(unreported)),
            )
        homes = self._home_keys(batch)
        if homes:  # where these conversations' text is cached now: here
            cur.execute(
                "INSERT INTO prefix_homes (prefix_key, replica_id) SELECT k, %s FROM "
                "unnest(%s::bigint[]) AS k ON CONFLICT (prefix_key) DO UPDATE SET "
                "replica_id = excluded.replica_id, updated_at = now()",
                (me, homes),
            )
        changed = [w for w in batch.workers.values() if w is not None]
        left = [worker_id for worker_id, w in batch.workers.items() if w is None]
        if changed:
            cur.executemany(
                "INSERT INTO workers (worker_id, replica_id, registration, drain_requested) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (worker_id) DO UPDATE SET "
                "replica_id = excluded.replica_id, registration = excluded.registration, "
                "drain_requested = excluded.drain_requested",
                [
                    (
                        w.registration.worker_id,
                        me,
                        registration_json(w.registration),
                        w.drain_requested,
                    )
                    for w in changed
                ],
            )
        if left:
            cur.execute(
                "DELETE FROM workers WHERE worker_id = ANY(%s) AND replica_id = %s", (left, me)
            )
        if batch.forgotten:
            forgotten = list(batch.forgotten)
            # Or no owner: a keeper took it off a finished row while this replica's lease
            # had run out (reclaim_expired); the row is still this replica's to drop.
            cur.execute(
                "DELETE FROM sequences WHERE seq_id = ANY(%s) AND (owner = %s OR "
                "(owner IS NULL AND state = 4))",
                (forgotten, me),
            )
        deltas = self._tenant_deltas(batch.tenant_service.items())
        if deltas:
            cur.executemany(
                "INSERT INTO tenant_service (tenant, served) VALUES (%s, %s) "
                "ON CONFLICT (tenant) DO UPDATE SET served = "
                "tenant_service.served + excluded.served",
                deltas,
            )


class _PooledConnection:
    """`with store._connection() as conn`: a pooled connection; psycopg's errors become
    StoreError (UNAVAILABLE), except Disowned, NotFound and QueueFull, which pass."""

    def __init__(self, pool: ConnectionPool, timeout: float) -> None:
        self._pool = pool
        self._timeout = timeout
        self._context = None

    def __enter__(self) -> psycopg.Connection:
        try:
            self._context = self._pool.connection(timeout=self._timeout)
            return self._context.__enter__()
        except (psycopg.Error, PoolTimeout) as err:
            raise StoreError(f"the database is unavailable: {_first_line(err)}") from None

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            self._context.__exit__(kind, error, traceback)
        except psycopg.Error as err:
            if error is None:
                raise _store_error(err) from None
        if isinstance(error, psycopg.Error):
            raise _store_error(error) from None
        return False


def _fold_all_tokens(conn) -> None:
    """Schema 3 to 4: every saved token of every sequence into its row's head (from the
    `tokens` rows of schema 2 and the token log of schema 3, in commit order)."""
    wanted = {row[0] for row in conn.execute("SELECT seq_id FROM sequences")}
    outputs = Outputs()
    for seq_id, start, blob in conn.execute(
        "SELECT seq_id, start, token_ids FROM tokens ORDER BY seq_id, start"
    ):
        if seq_id in wanted:
            outputs.add(seq_id, start, unpack_token_ids(blob))
    for (blob,) in conn.execute("SELECT entries FROM token_log ORDER BY id"):
        for seq_id, start, token_ids in unpack_entries(bytes(blob), wanted):
            outputs.add(seq_id, start, token_ids)
    if outputs.tokens:
        seq_ids = list(outputs.tokens)
        conn.execute(
            "UPDATE sequences s SET output_head = v.head, num_saved = v.n, log_replica = NULL, "
            "log_from = NULL FROM unnest(%s::bigint[], %s::bytea[], %s::integer[]) "
            "AS v(seq_id, head, n) WHERE s.seq_id = v.seq_id",
            (
                seq_ids,
                [pack_token_ids(outputs.tokens[s]) for s in seq_ids],
                [len(outputs.tokens[s]) for s in seq_ids],
            ),
        )


def _store_error(err: psycopg.Error) -> StoreError:
    if isinstance(err, psycopg.OperationalError):
        return StoreError(f"the database is unavailable: {_first_line(err)}")
    return StoreError(f"database error: {_first_line(err)}")


def _stored_sequence(row, output: list[int]) -> StoredSequence:
    (
        seq_id,
        params,
        prompt,
        state,
        worker_id,
        queue_key,
        cursor,
        prefilled,
        num_generated,
        at_admission,
        reason,
        finish_order,
        submitted_at,
        admission_order,
        error_message,
    ) = row
    return StoredSequence(
        seq_id=seq_id,
        params=params_from_row(params, bytes(prompt)),
        progress=SequenceProgress(
            seq_id=seq_id,
            state=SequenceState(state),
            worker_id=worker_id,
            queue_key=queue_key,
            cursor=cursor,
            prefilled_tokens=prefilled,
            num_generated=num_generated,
            num_generated_at_admission=at_admission,
            finish_reason=None if reason is None else FinishReason(reason),
            finish_order=finish_order,
            submitted_at=submitted_at,
            admission_order=admission_order,
            error_message=error_message,
        ),
        output_token_ids=output,
    )


def _ids_payload(seq_ids: Iterable[int]) -> str:
    payload = ",".join(str(s) for s in sorted(seq_ids))
    return payload if len(payload) <= _MAX_NOTIFY_PAYLOAD else "*"


def parse_ids_payload(payload: str) -> set[int] | None:
    """The ids of a lattice_progress notification; None means every sequence."""
    if payload == "*":
        return None
    return {int(part) for part in payload.split(",") if part}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _redacted(url: str) -> str:
    """The URL without a password, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{userinfo}{at}{host}"


def _refuse_while_live(conn, version: int) -> None:
    """A migration from `version` runs only when no replica holds a live lease: a replica
    of that version still running would read or write the old rows."""
    live = conn.execute("SELECT count(*) FROM replicas WHERE lease_until > now()").fetchone()[0]
    if live:
        raise ConfigError(
            f"the database holds schema version {version} and {live} replica(s) with a "
            f"live lease: stop every version-{version} replica (and wait for its lease to "
            f"run out) before a version-{SCHEMA_VERSION} replica starts"
        )
