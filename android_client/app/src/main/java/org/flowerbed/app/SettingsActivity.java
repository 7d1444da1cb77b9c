package org.flowerbed.app;

import android.app.Activity;
import android.content.Intent;
import android.net.Uri;
import android.os.Bundle;
import android.text.InputType;
import android.widget.Button;
import android.widget.CheckBox;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.ScrollView;
import android.widget.TextView;
import java.io.File;
import org.flowerbed.phone.EnrolmentUri;

/**
 * The one screen: enrol (scan the QR code of {@code flowerbed bridge enroll} with the camera, which
 * opens this screen, or paste the URI), set the training conditions, start and stop.
 */
public final class SettingsActivity extends Activity {
  private EditText uri;
  private CheckBox charging;
  private CheckBox unmetered;
  private CheckBox idle;
  private EditText minBattery;
  private TextView status;

  @Override
  protected void onCreate(Bundle saved) {
    super.onCreate(saved);
    AppSettings s = AppSettings.load(this);
    LinearLayout col = new LinearLayout(this);
    col.setOrientation(LinearLayout.VERTICAL);
    int pad = (int) (16 * getResources().getDisplayMetrics().density);
    col.setPadding(pad, pad, pad, pad);

    uri = field(col, "Enrolment URI (flowerbed://enroll?...)", "", InputType.TYPE_TEXT_VARIATION_URI);
    Button enrol = new Button(this);
    enrol.setText("Enrol");
    enrol.setOnClickListener(v -> enrol(uri.getText().toString()));
    col.addView(enrol);
    charging = check(col, "Train only while charging", s.requireCharging);
    unmetered = check(col, "Only on an unmetered network (Wi-Fi)", s.requireUnmetered);
    idle = check(col, "Only while the phone is idle", s.requireIdle);
    minBattery =
        field(col, "Lowest battery to start, %", Integer.toString(s.minBatteryPct),
            InputType.TYPE_CLASS_NUMBER);

    Button start = new Button(this);
    start.setText("Save and start");
    start.setOnClickListener(v -> start());
    col.addView(start);
    Button stop = new Button(this);
    stop.setText("Stop");
    stop.setOnClickListener(
        v -> {
          Scheduler.stop(this);
          status.setText("Stopped.");
        });
    col.addView(stop);

    TextView files = new TextView(this);
    files.setText("Local data: " + new File(getExternalFilesDir(null), TrainingWorker.DATA_FILE));
    col.addView(files);
    status = new TextView(this);
    col.addView(status);

    ScrollView scroll = new ScrollView(this);
    scroll.addView(col);
    setContentView(scroll);
    handle(getIntent());
  }

  @Override
  protected void onNewIntent(Intent intent) {
    super.onNewIntent(intent);
    handle(intent);
  }

  @Override
  protected void onResume() {
    super.onResume();
    status.setText("Last: " + AppSettings.lastLine(this));
  }

  /** A scanned enrolment QR code opens the app with its URI. */
  private void handle(Intent intent) {
    Uri data = intent == null ? null : intent.getData();
    if (data != null && Intent.ACTION_VIEW.equals(intent.getAction())) {
      enrol(data.toString());
    }
  }

  private void enrol(String text) {
    try {
      // Debug builds may enrol a plain-HTTP lab gateway (network_security_config still
      // limits cleartext to the hosts it lists); release builds need HTTPS.
      EnrolmentUri e = EnrolmentUri.parse(text, BuildConfig.DEBUG);
      KeystoreTokens.save(this, e);
      status.setText("Enrolled as " + e.phone + " at " + e.gateway + ". Start when ready.");
      uri.setText("");
    } catch (Exception ex) {
      status.setText("Not enrolled: " + ex.getMessage());
    }
  }

  private void start() {
    AppSettings s = new AppSettings();
    s.requireCharging = charging.isChecked();
    s.requireUnmetered = unmetered.isChecked();
    s.requireIdle = idle.isChecked();
    try {
      s.minBatteryPct = Integer.parseInt(minBattery.getText().toString().trim());
      s.policy(); // checks the range
      if (KeystoreTokens.load(this) == null) {
        throw new IllegalStateException("enrol first");
      }
    } catch (Exception ex) {
      status.setText("Not started: " + ex.getMessage());
      return;
    }
    s.save(this);
    Scheduler.start(this, s.policy());
    status.setText("Scheduled: trains whenever the conditions hold, also after a reboot.");
  }

  private EditText field(LinearLayout col, String label, String value, int variation) {
    TextView l = new TextView(this);
    l.setText(label);
    col.addView(l);
    EditText e = new EditText(this);
    e.setInputType(
        variation == InputType.TYPE_CLASS_NUMBER
            ? variation
            : InputType.TYPE_CLASS_TEXT | variation);
    e.setText(value);
    col.addView(e);
    return e;
  }

  private CheckBox check(LinearLayout col, String label, boolean value) {
    CheckBox c = new CheckBox(this);
    c.setText(label);
    c.setChecked(value);
    col.addView(c);
    return c;
  }
}
