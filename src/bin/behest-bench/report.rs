//! Distributions, figures and the printed table / JSON file.

use std::io::Write;
use std::time::Duration;

use serde::Serialize;

/// Duration in ms.
pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// A set of samples (ms, or any unit).
#[derive(Debug, Clone, Default)]
pub struct Dist {
    samples: Vec<f64>,
}

impl Dist {
    /// Adds a sample.
    pub fn push(&mut self, sample: f64) {
        self.samples.push(sample);
    }

    /// Adds every sample of another distribution.
    pub fn extend(&mut self, other: &Dist) {
        self.samples.extend_from_slice(&other.samples);
    }

    /// How many samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// The `p`th percentile (nearest rank), 0 when empty.
    pub fn p(&self, p: f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let mut sorted = self.samples.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    /// The mean, 0 when empty.
    pub fn mean(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        self.samples.iter().sum::<f64>() / self.samples.len() as f64
    }
}

/// How behest compares to the baseline.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Compare {
    /// behest − baseline.
    Difference,
    /// behest ÷ baseline.
    Ratio,
    /// No baseline.
    None,
}

/// A target: the value must be at most / at least this.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// The compared value (difference, or behest's value) must be at most this.
    AtMost(f64),
    /// The compared value must be at least this.
    AtLeast(f64),
}

/// One figure of one backend.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// What is measured.
    pub figure: String,
    /// `sqlite` or `postgres`.
    pub backend: String,
    /// Unit of baseline, behest and difference.
    pub unit: String,
    /// The same load directly against the fake provider.
    pub baseline: Option<f64>,
    /// Through behest.
    pub behest: f64,
    /// How they compare.
    pub compare: Compare,
    /// behest − baseline or behest ÷ baseline.
    pub delta: Option<f64>,
    /// What the target applies to: `delta` or `behest`.
    pub target_on: &'static str,
    /// The target, if the issue sets one.
    pub target: Option<Target>,
    /// Whether the target is met.
    pub met: Option<bool>,
    /// Samples behind the figure.
    pub samples: usize,
    /// How to read it.
    pub note: String,
}

impl Row {
    /// A figure compared to its baseline.
    pub fn new(
        figure: &str,
        unit: &str,
        baseline: Option<f64>,
        behest: f64,
        compare: Compare,
    ) -> Self {
        let delta = match (compare, baseline) {
            (Compare::Difference, Some(base)) => Some(behest - base),
            (Compare::Ratio, Some(base)) if base != 0.0 => Some(behest / base),
            _ => None,
        };
        Self {
            figure: figure.to_owned(),
            backend: String::new(),
            unit: unit.to_owned(),
            baseline,
            behest,
            compare,
            delta,
            target_on: "delta",
            target: None,
            met: None,
            samples: 0,
            note: String::new(),
        }
    }

    /// Sets a target on the difference (or on behest's value when there is no difference).
    pub fn target(mut self, target: Target) -> Self {
        let value = match self.compare {
            Compare::Difference => self.delta.unwrap_or(self.behest),
            _ => {
                self.target_on = "behest";
                self.behest
            }
        };
        self.met = Some(match target {
            Target::AtMost(limit) => value <= limit,
            Target::AtLeast(limit) => value >= limit,
        });
        self.target = Some(target);
        self
    }

    /// Sets a target on behest's own value (an absolute figure), keeping the comparison.
    pub fn target_absolute(mut self, target: Target) -> Self {
        self.target_on = "behest";
        self.met = Some(match target {
            Target::AtMost(limit) => self.behest <= limit,
            Target::AtLeast(limit) => self.behest >= limit,
        });
        self.target = Some(target);
        self
    }

    /// Sample count.
    pub fn samples(mut self, samples: usize) -> Self {
        self.samples = samples;
        self
    }

    /// How to read it.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }
}

fn number(value: f64) -> String {
    if value.abs() >= 1000.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn delta_text(row: &Row) -> String {
    match (row.compare, row.delta) {
        (Compare::Difference, Some(delta)) => {
            format!("{}{}", if delta >= 0.0 { "+" } else { "" }, number(delta))
        }
        (Compare::Ratio, Some(ratio)) => format!("×{ratio:.2}"),
        _ => "—".to_owned(),
    }
}

fn target_text(row: &Row) -> String {
    let prefix = if row.target_on == "delta" && row.compare == Compare::Difference {
        "Δ "
    } else {
        ""
    };
    match row.target {
        Some(Target::AtMost(limit)) => format!("{prefix}≤ {}", number(limit)),
        Some(Target::AtLeast(limit)) => format!("{prefix}≥ {}", number(limit)),
        None => "—".to_owned(),
    }
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| backend | figure | unit | baseline (direct) | behest | Δ / ratio | target | met |\n\
         |---|---|---|---:|---:|---:|---|---|\n",
    );
    for row in rows {
        let met = match row.met {
            Some(true) => "yes",
            Some(false) => "**NO**",
            None => "—",
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.backend,
            row.figure,
            row.unit,
            row.baseline.map_or("—".to_owned(), number),
            number(row.behest),
            delta_text(row),
            target_text(row),
            met
        ));
    }
    out
}

/// Writes text to stdout (the report); a closed pipe is not an error worth failing for.
pub fn say(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes());
    let _ = stdout.write_all(b"\n");
    let _ = stdout.flush();
}
