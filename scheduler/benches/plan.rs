//! Criterion benchmark of a full `plan` over a site.
//!
//! `site_1000x8/pending_10000` is the target scenario: 1,000 nodes of 8 GPUs in mixed builds (T4,
//! A100 40GB, A100 80GB, H100, shared T4s, mixed nodes), about a third of the GPUs busy, a few
//! unhealthy GPUs and offline nodes, and 10,000 pending sessions (mostly one GPU, some 2, 4 and
//! 8, mixed requirements, a few with a preferred node), more than the site can hold. A full plan
//! must take under 50 ms. `idle_site_1000x8/pending_10000` is the same site with nothing in use,
//! and `site_16x8/pending_100` a small site. Sites are generated from a fixed seed, so every run
//! plans the same input.
//!
//! `mixed_site_1250x8/pending_50000` is the target with batch jobs: 10,000 GPUs, of which
//! batch jobs hold about a fifth (one GPU each, most past their min duration, a few halting,
//! some past their max duration), and 50,000 pending requests: 20,000 sessions and 30,000
//! queued jobs (some with notBefore, notAfter or a bucket). Sessions that find no free GPU halt
//! jobs. A full plan must take under 50 ms on one core.

use chrono::{DateTime, TimeZone, Utc};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use ongrid_core::job::{Bucket, BucketName};
use ongrid_core::{
    GpuMode, GpuRequest, GpuUuid, HumanDuration, JobId, MemorySize, NodeName, SessionId, Sharing,
    UserName,
};
use ongrid_scheduler::{
    plan, Action, GpuSlot, NodeState, PendingSession, QueuedJob, RunningJob, SiteState,
};

/// SplitMix64: a small, fixed, good-enough generator, so the bench needs no `rand`.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Picks from `(weight, value)` pairs.
    fn weighted<T: Copy>(&mut self, choices: &[(u64, T)]) -> T {
        let total: u64 = choices.iter().map(|(weight, _)| weight).sum();
        let mut pick = self.below(total);
        for &(weight, value) in choices {
            if pick < weight {
                return value;
            }
            pick -= weight;
        }
        choices[choices.len() - 1].1
    }
}

#[derive(Clone, Copy)]
struct Model {
    capability: (u16, u16),
    memory_mib: u64,
}

const T4: Model = Model {
    capability: (7, 5),
    memory_mib: 15_360,
};
const A100_40: Model = Model {
    capability: (8, 0),
    memory_mib: 40_960,
};
const A100_80: Model = Model {
    capability: (8, 0),
    memory_mib: 81_920,
};
const H100: Model = Model {
    capability: (9, 0),
    memory_mib: 81_559,
};

const EXCLUSIVE: GpuMode = GpuMode::Exclusive;
const SHARED_2: GpuMode = GpuMode::Shared { max_sessions: 2 };
const SHARED_4: GpuMode = GpuMode::Shared { max_sessions: 4 };

/// A node build: 8 GPUs as (model, mode).
type Build = [(Model, GpuMode); 8];

const BUILDS: [(u64, Build); 6] = [
    (30, [(T4, EXCLUSIVE); 8]),
    (25, [(A100_40, EXCLUSIVE); 8]),
    (20, [(A100_80, EXCLUSIVE); 8]),
    (15, [(H100, EXCLUSIVE); 8]),
    (5, [(T4, SHARED_4); 8]),
    (
        5,
        [
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (A100_40, SHARED_2),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
            (T4, EXCLUSIVE),
        ],
    ),
];

struct Scenario {
    nodes: usize,
    pending: usize,
    busy: bool,
    /// Every GPU of a random build, so that nearly every node differs from every other.
    scrambled: bool,
    /// Batch jobs: busy whole GPUs are held by running jobs (60 in 100), and this many in 100
    /// pending requests are queued jobs.
    jobs_percent: u64,
}

fn at(second: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_750_000_000 + second, 0)
        .single()
        .expect("valid time")
}

fn node_name(n: usize) -> NodeName {
    NodeName::parse(&format!("gpu-node-{n:04}")).expect("valid node name")
}

fn user(n: u64) -> UserName {
    UserName::parse(&format!("user{n}")).expect("valid user name")
}

fn request(random: &mut Random) -> GpuRequest {
    GpuRequest {
        count: random.weighted(&[(85, 1), (8, 2), (5, 4), (2, 8)]),
        min_capability: random
            .weighted(&[
                (50, None),
                (10, Some((7, 5))),
                (30, Some((8, 0))),
                (10, Some((9, 0))),
            ])
            .map(|(major, minor)| ongrid_core::ComputeCapability::new(major, minor)),
        min_memory: random
            .weighted(&[(60, None), (25, Some("40G")), (15, Some("80G"))])
            .map(|memory| memory.parse().expect("valid memory")),
        sharing: random.weighted(&[
            (80, Sharing::Exclusive),
            (12, Sharing::Any),
            (8, Sharing::Shared),
        ]),
    }
}

fn site(scenario: &Scenario) -> SiteState {
    let mut random = Random(0x6f6e_6772_6964);
    let mut running_jobs = Vec::new();
    let mut job_number = 0u64;
    let mut next_job = |random: &mut Random| {
        job_number += 1;
        format!("{:016x}{job_number:016x}", random.next())
            .parse::<JobId>()
            .expect("valid job id")
    };
    let nodes: Vec<NodeState> = (0..scenario.nodes)
        .map(|n| {
            let build = random.weighted(&BUILDS);
            let gpus = (0..build.len())
                .map(|g| {
                    let (model, mode) = if scenario.scrambled {
                        random.weighted(&BUILDS)[g]
                    } else {
                        build[g]
                    };
                    let used = match (scenario.busy && random.chance(35), mode) {
                        (false, _) => 0,
                        (true, GpuMode::Exclusive) => 1,
                        (true, mode) => 1 + random.below(u64::from(mode.capacity())) as u32,
                    };
                    let uuid = GpuUuid::parse(&format!(
                        "GPU-{n:08x}-{g:04x}-0000-0000-{:012x}",
                        random.below(1 << 48)
                    ))
                    .expect("valid UUID");
                    let by_job = scenario.jobs_percent > 0
                        && used == 1
                        && mode == GpuMode::Exclusive
                        && random.chance(60);
                    if by_job {
                        let started = random.below(86_400) as i64;
                        running_jobs.push(RunningJob {
                            id: next_job(&mut random),
                            owner: user(random.below(200)),
                            node: node_name(n),
                            gpus: vec![uuid.clone()],
                            started_at: at(started),
                            max_duration: Some(HumanDuration::from_secs(20 * 3600)),
                            min_duration: Some(HumanDuration::from_secs(3600)),
                            bucket: None,
                            halting: random.chance(5),
                        });
                    }
                    GpuSlot {
                        uuid,
                        capability: ongrid_core::ComputeCapability::new(
                            model.capability.0,
                            model.capability.1,
                        ),
                        memory: MemorySize::from_mib(model.memory_mib),
                        mode,
                        healthy: !random.chance(1),
                        drained: false,
                        used,
                    }
                })
                .collect();
            NodeState {
                name: node_name(n),
                online: !random.chance(2),
                drained: false,
                gpus,
            }
        })
        .collect();
    let jobs = scenario.pending as u64 * scenario.jobs_percent / 100;
    let queued_jobs = (0..jobs)
        .map(|_| {
            let request = request(&mut random);
            QueuedJob {
                id: next_job(&mut random),
                owner: user(random.below(200)),
                request,
                queued_at: at(random.below(86_400) as i64),
                not_before: random
                    .chance(10)
                    .then(|| at(random.below(2 * 86_400) as i64)),
                not_after: random
                    .chance(10)
                    .then(|| at(random.below(2 * 86_400) as i64)),
                bucket: random.chance(20).then(|| Bucket {
                    name: BucketName::parse(&format!("b{}", random.below(5))).expect("valid"),
                    max: 1 + random.below(8) as u32,
                }),
                pinned_node: None,
                priority: Default::default(),
            }
        })
        .collect();
    let pending = (0..scenario.pending - jobs as usize)
        .map(|n| {
            let request = request(&mut random);
            let preferred_node = random
                .chance(5)
                .then(|| node_name(random.below(scenario.nodes as u64) as usize));
            // Released sessions go back to their node.
            let pinned_node = random
                .chance(2)
                .then(|| node_name(random.below(scenario.nodes as u64) as usize));
            PendingSession {
                id: format!("{:016x}{n:016x}", random.next())
                    .parse::<SessionId>()
                    .expect("valid session id"),
                request,
                queued_at: at(random.below(86_400) as i64),
                preferred_node,
                pinned_node,
                previous_gpus: Vec::new(),
                awaiting_halt: None,
                priority: Default::default(),
            }
        })
        .collect();
    SiteState {
        nodes,
        pending,
        queued_jobs,
        running_jobs,
        ..SiteState::default()
    }
}

fn bench(c: &mut Criterion) {
    let scenarios = [
        (
            "site_16x8/pending_100",
            Scenario {
                nodes: 16,
                pending: 100,
                busy: true,
                scrambled: false,
                jobs_percent: 0,
            },
        ),
        (
            // A scheduling round's queue while sessions arrive steadily: what the plan costs
            // beside the site it reads (the index of its GPUs).
            "site_1000x8/pending_32",
            Scenario {
                nodes: 1000,
                pending: 32,
                busy: true,
                scrambled: false,
                jobs_percent: 0,
            },
        ),
        (
            "site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: true,
                scrambled: false,
                jobs_percent: 0,
            },
        ),
        (
            "idle_site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: false,
                scrambled: false,
                jobs_percent: 0,
            },
        ),
        (
            "scrambled_site_1000x8/pending_10000",
            Scenario {
                nodes: 1000,
                pending: 10_000,
                busy: true,
                scrambled: true,
                jobs_percent: 0,
            },
        ),
        (
            "mixed_site_1250x8/pending_50000",
            Scenario {
                nodes: 1250,
                pending: 50_000,
                busy: true,
                scrambled: false,
                jobs_percent: 60,
            },
        ),
    ];
    let mut group = c.benchmark_group("plan");
    for (name, scenario) in &scenarios {
        let site = site(scenario);
        let actions = plan(&site, at(86_400));
        let count = |f: fn(&Action) -> bool| actions.iter().filter(|a| f(a)).count();
        eprintln!(
            "{name}: {} GPUs, {} running jobs; of {} sessions {} placed, {} placed after halting; \
             of {} queued jobs {} started, {} cancelled; {} jobs halted",
            site.nodes.iter().map(|n| n.gpus.len()).sum::<usize>(),
            site.running_jobs.len(),
            site.pending.len(),
            count(|a| matches!(a, Action::Place { .. })),
            count(|a| matches!(a, Action::PlaceAfterHalt { .. })),
            site.queued_jobs.len(),
            count(|a| matches!(a, Action::StartJob { .. })),
            count(|a| matches!(a, Action::CancelJob { .. })),
            count(|a| matches!(a, Action::HaltJob { .. })),
        );
        group.bench_function(*name, |b| b.iter(|| plan(black_box(&site), at(86_400))));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
