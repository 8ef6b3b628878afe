//! `devctl freeze SESSION --tag NAME:VERSION`: asks the manager for an image
//! (`POST /v1/images`), then follows it until it is READY or FAILED, showing the progress on
//! stderr. The manager does the waiting: `GET /v1/images/{name:version}?after=DONE/TOTAL&timeout=`
//! answers as soon as the agent's report changes the image's state or progress, so devctl never
//! sleeps between requests. The result (SIF path, digest, size, Docker image) goes to stdout,
//! or the image as JSON with `--json`.

use std::time::{Duration, Instant};

use clap::Args;
use indicatif::ProgressDrawTarget;
use ongrid_core::image::{
    Compression, CreateImage, ImageProgress, ImageReference, ImageState, ImageView,
};
use ongrid_core::SessionName;

use super::catalog::path_segment;
use super::progress::Progress;
use crate::client::{Client, ClientError};
use crate::format::{format_bytes, or_dash};
use crate::terminal::Terminal;

/// The longest one wait asks the manager for: well within devctl's request timeout.
pub const WAIT_STEP: Duration = Duration::from_secs(20);
/// How often `freeze` prints a progress line when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Args)]
pub struct FreezeArgs {
    /// The session to freeze (it keeps running; HELD sessions can be frozen too)
    pub session: SessionName,
    /// Name and version of the image, like mymodel:v1
    #[arg(long, value_name = "NAME:VERSION")]
    pub tag: ImageReference,
    /// Move the tag if you already have an image of it (the old one stays reachable by its
    /// digest)
    #[arg(long)]
    pub force: bool,
    /// Compression of the squashfs inside the SIF: gzip mounts everywhere, zstd is smaller
    /// and faster (Apptainer ≥ 1.1)
    #[arg(long, default_value = "gzip", value_parser = parse_compression)]
    pub compression: Compression,
    /// Return at once, with the image BUILDING; follow it with devctl image show
    #[arg(long)]
    pub no_wait: bool,
    /// Print the image as JSON instead of text (no progress bar)
    #[arg(long)]
    pub json: bool,
}

fn parse_compression(value: &str) -> Result<Compression, String> {
    match value {
        "gzip" => Ok(Compression::Gzip),
        "zstd" => Ok(Compression::Zstd),
        other => Err(format!("compression {other:?} must be gzip or zstd")),
    }
}

/// `devctl freeze SESSION --tag NAME:VERSION`.
pub async fn run(args: FreezeArgs, client: &Client, term: &mut Terminal<'_>) -> anyhow::Result<()> {
    let body = CreateImage {
        session: args.session.clone(),
        reference: args.tag.clone(),
        force: args.force,
        compression: args.compression,
    };
    let image: ImageView = client
        .post("v1/images")
        .json(&body)
        .if_lost("the freeze may have started: devctl image ls")
        .send()
        .await?;
    if args.no_wait {
        return term.show(args.json, &image, |image| {
            format!(
                "freezing session {} to {} on {} (BUILDING): follow it with `devctl image show \
                 {}`\n",
                image.session, image.reference, image.node, image.reference
            )
        });
    }
    term.note(&format!(
        "freezing session {} to {} on {} (interrupting devctl does not stop the freeze)",
        image.session, image.reference, image.node
    ));
    let mut progress = if args.json {
        Progress::silent()
    } else if term.note_is_terminal {
        Progress::bar(ProgressDrawTarget::stderr())
    } else {
        Progress::lines(PLAIN_PROGRESS_EVERY)
    };
    let image = wait_until_built(image, client, &mut progress, term).await;
    progress.finish();
    let image = image?;
    match image.state {
        ImageState::Ready => term.show(args.json, &image, render_frozen),
        _ => anyhow::bail!(
            "freezing session {} to {} failed ({}): {}",
            image.session,
            image.reference,
            image.state,
            image.reason
        ),
    }
}

/// Follows the image while it is BUILDING, showing its progress: each request names the
/// progress shown so far and the manager answers when it changed (or after [`WAIT_STEP`]).
async fn wait_until_built(
    mut image: ImageView,
    client: &Client,
    progress: &mut Progress,
    term: &mut Terminal<'_>,
) -> anyhow::Result<ImageView> {
    let reference = image.reference.to_string();
    while image.state == ImageState::Building {
        let seen = building_progress(&image);
        image = wait_for_change(client, &reference, seen, WAIT_STEP).await?;
        // A finished image carries no progress: the display keeps the last one reported.
        if image.state == ImageState::Building {
            progress.update(building_progress(&image), Instant::now(), &mut *term.note);
        }
    }
    Ok(image)
}

/// A BUILDING image's progress; none reported yet is 0 of an unknown total.
fn building_progress(image: &ImageView) -> ImageProgress {
    image.progress.unwrap_or(ImageProgress {
        bytes_done: 0,
        bytes_total: 0,
    })
}

/// `GET /v1/images/{reference}?after=DONE/TOTAL&timeout=SECONDS`: the image once it is no
/// longer BUILDING or its progress is not `seen`, or as it is after `wait` (whole seconds).
pub async fn wait_for_change(
    client: &Client,
    reference: &str,
    seen: ImageProgress,
    wait: Duration,
) -> Result<ImageView, ClientError> {
    client
        .get(&format!("v1/images/{}", path_segment(reference)))
        .query(&[
            ("after", format!("{}/{}", seen.bytes_done, seen.bytes_total)),
            ("timeout", wait.as_secs().max(1).to_string()),
        ])
        .send()
        .await
}

/// What `freeze` prints when the image is READY.
pub fn render_frozen(image: &ImageView) -> String {
    format!(
        "image {} is READY\n  SIF:          {}\n  digest:       {}\n  size:         {}\n  \
         Docker image: {} (on node {})\n",
        image.reference,
        or_dash(image.sif_path.clone()),
        or_dash(image.digest.clone()),
        or_dash(image.size.map(format_bytes)),
        or_dash(image.docker_image.clone()),
        image.node,
    )
}
