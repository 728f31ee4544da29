"""A train-shard job over several machines, gathered through Postgres. The worker that
claims the job leads: it records node 0 of a new gathering of the job's gang with the
address its rank 0 will listen on, and calls for the other nodes with join messages on the
train queue. A worker that takes one records the next node of that gathering and starts its
ranks against that address; torch.distributed's own rendezvous (its TCP store, env://) does
the rest.

The gang goes on from job to job: every node keeps its ranks (their process group, model
and state) after a job, the run's next job comes back to its leader (models/train/
routing.py), and the leader's gathering for it keeps the same rendezvous and calls each
member on a queue of its own (its place in the run's gang) to go on with its ranks. A
member that cannot (its ranks are gone) does not join, and the gathering fails as an
outage; so does one that the leader's own ranks cannot go on with. The job then gathers
anew, with new ranks on every node.

Nothing waits for ever, and a lost node costs the job no attempt. While their ranks run,
the nodes note every second that they are seen (by the database's clock, so no machine's
own clock matters) and watch the others: a node unseen for `node_timeout_seconds` (its
machine or worker died, in the rendezvous or mid-job) fails the gathering as an outage
within seconds, as does a gang that has not gathered in time; the job is sent again, goes
on from its last checkpoint, and gathers anew under the next number. A member stops its
ranks as soon as the job has left the gathering it joined.

The leader's side is leader.py, a member's member.py; the gathering's rows, sightings and
lost nodes, which both read and write, gathering.py.
"""
