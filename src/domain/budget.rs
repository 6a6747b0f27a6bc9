//! Budgets (CONTRACT.md §18) as rules over values: a user's budgets and the periods they
//! count, what the user has spent in them, and when a start or a going run passes one.

use chrono::{DateTime, Datelike, TimeZone, Utc};

use crate::config::Settings;

/// What a user has spent in the budgets' periods: the runs that ended, the going runs' spend
/// so far, and what the going runs hold for their next model call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spend {
    /// Input and output tokens since the day began.
    pub tokens: u64,
    pub reserved_tokens: u64,
    /// US dollars since the month began.
    pub usd: f64,
    pub reserved_usd: f64,
}

/// A user's budgets and the periods they count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budgets {
    pub tokens_per_day: Option<u64>,
    pub usd_per_month: Option<f64>,
    /// Where the UTC day and the calendar month of `at` began.
    pub day_start: DateTime<Utc>,
    pub month_start: DateTime<Utc>,
}

impl Budgets {
    /// `user`'s budgets at `at`; `None` where none is set.
    pub fn of(settings: &Settings, user: &str, at: DateTime<Utc>) -> Option<Self> {
        let (tokens_per_day, usd_per_month) = settings.limits.budget_for(user);
        if tokens_per_day.is_none() && usd_per_month.is_none() {
            return None;
        }
        let day_start = Utc.from_utc_datetime(&at.date_naive().and_hms_opt(0, 0, 0).expect("midnight exists"));
        Some(Self { tokens_per_day, usd_per_month, day_start, month_start: first_of_month(at.year(), at.month()) })
    }

    /// Whether `spend`, the going runs' holds and `more` pass a budget (a start).
    pub fn passed_with(&self, spend: &Spend, more_tokens: u64, more_usd: f64) -> bool {
        self.tokens_per_day.is_some_and(|limit| spend.tokens + spend.reserved_tokens + more_tokens > limit)
            || self.usd_per_month.is_some_and(|limit| spend.usd + spend.reserved_usd + more_usd > limit)
    }

    /// Whether what has been spent, holds aside, reaches a budget (a going run stops).
    pub fn spent(&self, spend: &Spend) -> bool {
        self.tokens_per_day.is_some_and(|limit| spend.tokens >= limit)
            || self.usd_per_month.is_some_and(|limit| spend.usd >= limit)
    }

    /// When the day's budget resets.
    pub fn next_day(&self) -> DateTime<Utc> {
        self.day_start + chrono::Duration::days(1)
    }

    /// When the month's budget resets.
    pub fn next_month(&self) -> DateTime<Utc> {
        let (year, month) = match self.month_start.month() {
            12 => (self.month_start.year() + 1, 1),
            month => (self.month_start.year(), month + 1),
        };
        first_of_month(year, month)
    }
}

fn first_of_month(year: i32, month: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(year, month, 1, 0, 0, 0).single().expect("the first of a month exists")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_begin_at_utc_midnight_and_the_first_and_reset_after() {
        let settings = Settings::with_overrides(
            "[limits]\nbudget_usd_per_month = 5.0\n[limits.budgets.bob]\ntokens_per_day = 10\n",
        )
        .unwrap();
        let at = Utc.with_ymd_and_hms(2026, 12, 31, 23, 59, 0).unwrap();
        let ann = Budgets::of(&settings, "ann", at).unwrap();
        assert_eq!((ann.tokens_per_day, ann.usd_per_month), (None, Some(5.0)));
        assert_eq!(ann.day_start, Utc.with_ymd_and_hms(2026, 12, 31, 0, 0, 0).unwrap());
        assert_eq!(ann.month_start, Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap());
        assert_eq!(ann.next_day(), Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap());
        assert_eq!(ann.next_month(), Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap());
        // Bob's own budget replaces the general one where it is given.
        let bob = Budgets::of(&settings, "bob", at).unwrap();
        assert_eq!((bob.tokens_per_day, bob.usd_per_month), (Some(10), Some(5.0)));
        let spend = Spend { tokens: 6, reserved_tokens: 3, ..Spend::default() };
        assert!(!bob.passed_with(&spend, 1, 0.0) && bob.passed_with(&spend, 2, 0.0));
        assert!(!bob.spent(&spend) && bob.spent(&Spend { tokens: 10, ..spend }));
        assert!(Budgets::of(&Settings::with_overrides("").unwrap(), "ann", at).is_none());
    }
}
